"""Settings: flags first, then AGL_STREAM_* / AGL_* environment variables, then defaults.

A bad value stops the process with a sentence that names the flag and the variable; secret
values (passwords, database URLs with credentials) are never echoed.
"""

from __future__ import annotations

import os
import re
import ssl
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "AGL_STREAM_"
DEFAULT_BROKER_PORT = 19092
DEFAULT_POSTGRES_PORT = 15432
DEFAULT_REGISTRY_PORT = 18081

_HOST_PORT = re.compile(r"^\[?[A-Za-z0-9_.:-]+\]?:\d{1,5}$")


class ConfigError(Exception):
    """Bad configuration; the message is meant for a person and names what to change."""


class _Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="ignore", frozen=True, validate_default=True
    )


class KafkaSettings(_Settings):
    """How to reach the Kafka cluster (or the embedded broker)."""

    bootstrap_servers: str = Field(
        default=f"127.0.0.1:{DEFAULT_BROKER_PORT}",
        description="Comma-separated host:port list of brokers.",
    )
    client_id: str = Field(default="agl-stream", description="Client id sent to the brokers.")
    topic_prefix: str = Field(
        default="agl.",
        pattern=r"^[A-Za-z0-9._-]*$",
        description="Prefix of every topic name: tasks becomes agl.tasks.",
    )
    replication_factor: int = Field(
        default=1, ge=1, description="Replication factor of topics that `topics apply` creates."
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: (
        Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "GSSAPI", "OAUTHBEARER"] | None
    ) = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: Path | None = Field(default=None, description="CA bundle to verify brokers.")
    ssl_certfile: Path | None = Field(default=None, description="Client certificate (mTLS).")
    ssl_keyfile: Path | None = Field(default=None, description="Client private key (mTLS).")
    ssl_password: SecretStr | None = Field(default=None, description="Password of the key.")
    request_timeout_ms: int = Field(default=30_000, ge=1_000)

    @field_validator("bootstrap_servers")
    @classmethod
    def _host_ports(cls, value: str) -> str:
        servers = [s.strip() for s in value.split(",") if s.strip()]
        bad = [
            s
            for s in servers
            if not _HOST_PORT.match(s) or not 0 < int(s.rsplit(":", 1)[1]) < 65536
        ]
        if not servers or bad:
            raise ValueError("expected host:port[,host:port...]")
        return ",".join(servers)

    @field_validator("ssl_cafile", "ssl_certfile", "ssl_keyfile")
    @classmethod
    def _readable(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"file {value} does not exist")
        return value

    @model_validator(mode="after")
    def _consistent_security(self) -> KafkaSettings:
        sasl = self.security_protocol.startswith("SASL")
        if sasl and self.sasl_mechanism is None:
            raise ValueError(
                f"AGL_STREAM_SECURITY_PROTOCOL {self.security_protocol} needs "
                "AGL_STREAM_SASL_MECHANISM"
            )
        if (
            sasl
            and self.sasl_mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
            and (not self.sasl_username or self.sasl_password is None)
        ):
            raise ValueError(
                f"SASL {self.sasl_mechanism} needs AGL_STREAM_SASL_USERNAME and "
                "AGL_STREAM_SASL_PASSWORD"
            )
        if not sasl and self.sasl_mechanism is not None:
            raise ValueError(
                "AGL_STREAM_SASL_MECHANISM is set but the security protocol "
                f"{self.security_protocol} does not use SASL"
            )
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("AGL_STREAM_SSL_CERTFILE and AGL_STREAM_SSL_KEYFILE go together")
        return self

    def client_options(self) -> dict[str, Any]:
        """Keyword arguments shared by aiokafka's producer, consumer and admin client."""
        options: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers,
            "client_id": self.client_id,
            "request_timeout_ms": self.request_timeout_ms,
            "security_protocol": self.security_protocol,
        }
        if self.security_protocol in ("SSL", "SASL_SSL"):
            options["ssl_context"] = self._ssl_context()
        if self.sasl_mechanism is not None:
            options["sasl_mechanism"] = self.sasl_mechanism
            options["sasl_plain_username"] = self.sasl_username
            if self.sasl_password is not None:
                options["sasl_plain_password"] = self.sasl_password.get_secret_value()
        return options

    def _ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(
            cafile=str(self.ssl_cafile) if self.ssl_cafile else None
        )
        if self.ssl_certfile is not None and self.ssl_keyfile is not None:
            context.load_cert_chain(
                str(self.ssl_certfile),
                str(self.ssl_keyfile),
                self.ssl_password.get_secret_value() if self.ssl_password else None,
            )
        return context

    def topic(self, short_name: str) -> str:
        return f"{self.topic_prefix}{short_name}"

    def describe(self) -> dict[str, str]:
        """For display: everything but secrets."""
        shown = {
            "bootstrap servers": self.bootstrap_servers,
            "topic prefix": self.topic_prefix,
            "security protocol": self.security_protocol,
        }
        if self.sasl_mechanism:
            shown["sasl"] = f"{self.sasl_mechanism} as {self.sasl_username}"
        return shown


class DatabaseSettings(_Settings):
    """How to reach PostgreSQL."""

    database_url: SecretStr = Field(
        default=SecretStr(f"postgresql://agl@127.0.0.1:{DEFAULT_POSTGRES_PORT}/agl_stream"),
        description="postgresql://user:password@host:port/database",
    )

    @field_validator("database_url")
    @classmethod
    def _postgres_url(cls, value: SecretStr) -> SecretStr:
        parts = urlsplit(value.get_secret_value())
        if parts.scheme not in ("postgresql", "postgres", "postgresql+asyncpg"):
            raise ValueError("expected a postgresql://user:password@host:port/database URL")
        if not parts.hostname or not parts.path.strip("/"):
            raise ValueError("the URL must name a host and a database")
        for host in parts.netloc.rpartition("@")[2].split(","):  # libpq takes h1:p1,h2:p2
            port = host.rpartition("]")[2].rpartition(":")[2] if ":" in host else ""
            if port and not (port.isdigit() and 0 < int(port) < 65536):
                raise ValueError(f"port {port[:20]!r} is not a port number (1-65535)")
        return value

    @property
    def asyncpg_dsn(self) -> str:
        """The URL as asyncpg takes it (postgresql:// scheme)."""
        parts = urlsplit(self.database_url.get_secret_value())
        return urlunsplit(parts._replace(scheme="postgresql"))

    @property
    def sqlalchemy_url(self) -> str:
        parts = urlsplit(self.database_url.get_secret_value())
        return urlunsplit(parts._replace(scheme="postgresql+asyncpg"))

    @property
    def database_name(self) -> str:
        return urlsplit(self.database_url.get_secret_value()).path.strip("/")

    def display_url(self) -> str:
        """The URL with any password masked."""
        parts = urlsplit(self.database_url.get_secret_value())
        netloc = parts.netloc
        if parts.password is not None:
            netloc = netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))

    def with_database(self, name: str) -> DatabaseSettings:
        parts = urlsplit(self.database_url.get_secret_value())
        return DatabaseSettings(database_url=SecretStr(urlunsplit(parts._replace(path=f"/{name}"))))


class StackSettings(_Settings):
    """Where and on which ports `agl-stream up` runs the embedded stack."""

    home: Path = Field(default=Path(".agl-stream"), description="State directory of the stack.")
    broker_port: int = Field(default=DEFAULT_BROKER_PORT, gt=0, lt=65536)
    postgres_port: int = Field(default=DEFAULT_POSTGRES_PORT, gt=0, lt=65536)
    kafka_nodes: int = Field(
        default=1, ge=1, le=9, description="Kafka nodes (KRaft broker+controller) on loopback."
    )
    registry: bool = Field(
        default=False,
        description="Also run a schema registry (Apicurio; for AGL_STREAM_WIRE=confluent).",
    )
    registry_port: int = Field(default=DEFAULT_REGISTRY_PORT, gt=0, lt=65536)

    @field_validator("home")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        return value.expanduser().absolute()

    @model_validator(mode="after")
    def _two_ports(self) -> StackSettings:
        if self.broker_port == self.postgres_port:
            raise ValueError(
                f"the broker and PostgreSQL cannot both listen on port {self.broker_port}"
            )
        if self.registry and self.registry_port in (self.broker_port, self.postgres_port):
            raise ValueError(
                f"the schema registry cannot listen on port {self.registry_port}, which the "
                "broker or PostgreSQL uses"
            )
        return self


class WireSettings(_Settings):
    """How producers frame events on the topics, and the schema registry consumers ask about
    the Confluent framing's schema ids (docs/operations/schema-registry.md)."""

    wire: Literal["single-object", "confluent"] = Field(
        default="single-object",
        description="What producers write: Avro single-object encoding (no server needed) or "
        "the Confluent schema-registry framing. Consumers read both.",
    )
    schema_registry_url: str | None = Field(
        default=None,
        description="The registry's Confluent API (Apicurio: http://host:port/apis/ccompat/v7).",
    )

    @field_validator("schema_registry_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError("expected an http:// or https:// URL of the registry's Confluent API")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _registry_for_confluent(self) -> WireSettings:
        if self.wire == "confluent" and self.schema_registry_url is None:
            raise ValueError(
                "AGL_STREAM_WIRE confluent needs AGL_STREAM_SCHEMA_REGISTRY_URL, the schema "
                "registry's Confluent API (such as http://127.0.0.1:18081/apis/ccompat/v7)"
            )
        return self


_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


class TorchSettings(_Settings):
    """Where and in what precision torch runs a model: the trainer, retrain, the policy
    server and the in-process sampler. Whether the device exists is checked when the model
    is placed (agl_stream/training/device.py), with a sentence naming the setting."""

    device: str = Field(
        default="auto", description="auto (a CUDA device if torch sees one), cpu, cuda or cuda:N."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="Weights' precision; auto: bfloat16 on a GPU that has it, else float32.",
    )
    threads: int | None = Field(
        default=None, ge=1, description="torch's intra-op threads. [default: the role's own]"
    )

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not _DEVICE.match(value):
            raise ValueError("expected auto, cpu, cuda or cuda:N")
        return value


S = TypeVar("S", bound=_Settings)

# Which flag sets each setting, for error messages.
FLAGS = {
    "bootstrap_servers": "--bootstrap-servers",
    "topic_prefix": "--topic-prefix",
    "database_url": "--database-url",
    "home": "--home",
    "broker_port": "--broker-port",
    "postgres_port": "--postgres-port",
    "kafka_nodes": "--kafka-nodes",
    "registry": "--registry",
    "registry_port": "--registry-port",
    "device": "--device",
    "dtype": "--dtype",
    "threads": "--threads",
    "redact_keys": "--redact-key",
    "redact_patterns": "--redact-pattern",
}
SECRET_FIELDS = {"sasl_password", "ssl_password", "database_url", "api_token", "upstream_token"}


def load(cls: type[S], **overrides: Any) -> S:
    """Build settings from flags (overrides that are not None) and the environment; a bad
    value raises ConfigError naming the flag and the environment variable."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return cls(**given)
    except ValidationError as exc:
        raise ConfigError(_explain(exc)) from None


def _explain(exc: ValidationError) -> str:
    sentences = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else ""
        message = str(error["msg"]).removeprefix("Value error, ")
        if not field:
            sentences.append(f"Invalid configuration: {message}.")
            continue
        names = [f"{ENV_PREFIX}{field.upper()}"]
        if field in FLAGS:
            names.insert(0, FLAGS[field])
        shown = ""
        if field not in SECRET_FIELDS and error.get("input") is not None:
            shown = f" {error['input']!r}"
        sentences.append(f"Invalid setting {' / '.join(names)}{shown}: {message}.")
    return " ".join(sentences)


def current_role(default: str | None = None) -> str | None:
    """AGL_CURRENT_ROLE, as Agent Lightning users set it; its `algorithm` is a worker's
    `trainer` (`both` belongs to Trainer.fit, which runs every role)."""
    role = os.environ.get("AGL_CURRENT_ROLE", default)
    return "trainer" if role == "algorithm" else role


def child_environment(
    kafka: KafkaSettings, database: DatabaseSettings | None = None
) -> dict[str, str]:
    """This process's environment plus the AGL_STREAM_* variables that hand these settings
    to a worker started as a child process (every Kafka setting given, credentials too)."""
    env = dict(os.environ)
    for name, value in kafka.model_dump().items():
        if value is None:
            env.pop(f"{ENV_PREFIX}{name.upper()}", None)
            continue
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        env[f"{ENV_PREFIX}{name.upper()}"] = str(value)
    if database is not None:
        env[f"{ENV_PREFIX}DATABASE_URL"] = database.database_url.get_secret_value()
    return env
