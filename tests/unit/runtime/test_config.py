"""Settings from flags and environment; bad values stop with a sentence; secrets stay hidden."""

from __future__ import annotations

import pytest

from agl_stream.embedded.stack import StackState
from agl_stream.runtime.config import (
    ConfigError,
    DatabaseSettings,
    KafkaSettings,
    StackSettings,
    load,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("AGL_STREAM_"):
            monkeypatch.delenv(key)


def test_defaults_point_at_the_embedded_stack() -> None:
    assert load(KafkaSettings).bootstrap_servers == "127.0.0.1:19092"
    assert load(DatabaseSettings).asyncpg_dsn == "postgresql://agl@127.0.0.1:15432/agl_stream"


def test_environment_then_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGL_STREAM_BOOTSTRAP_SERVERS", "k1:9092, k2:9092")
    monkeypatch.setenv("AGL_STREAM_TOPIC_PREFIX", "team.")
    assert load(KafkaSettings).bootstrap_servers == "k1:9092,k2:9092"
    flagged = load(KafkaSettings, bootstrap_servers="k3:9092", topic_prefix=None)
    assert flagged.bootstrap_servers == "k3:9092"
    assert flagged.topic("tasks") == "team.tasks"


@pytest.mark.parametrize(
    ("env", "value", "words"),
    [
        (
            "AGL_STREAM_BOOTSTRAP_SERVERS",
            "localhost",
            "--bootstrap-servers / AGL_STREAM_BOOTSTRAP_SERVERS 'localhost'",
        ),
        ("AGL_STREAM_BOOTSTRAP_SERVERS", "host:99999", "expected host:port"),
        ("AGL_STREAM_SECURITY_PROTOCOL", "TLS", "AGL_STREAM_SECURITY_PROTOCOL 'TLS'"),
        ("AGL_STREAM_REPLICATION_FACTOR", "zero", "AGL_STREAM_REPLICATION_FACTOR"),
        ("AGL_STREAM_TOPIC_PREFIX", "bad prefix!", "AGL_STREAM_TOPIC_PREFIX"),
        ("AGL_STREAM_SSL_CAFILE", "/nonexistent/ca.pem", "does not exist"),
    ],
)
def test_bad_kafka_values_are_named(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, words: str
) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(ConfigError) as info:
        load(KafkaSettings)
    assert words in str(info.value)
    assert str(info.value).startswith("Invalid")


def test_sasl_needs_credentials_and_never_prints_the_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AGL_STREAM_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("AGL_STREAM_SASL_MECHANISM", "SCRAM-SHA-512")
    with pytest.raises(ConfigError, match="AGL_STREAM_SASL_USERNAME"):
        load(KafkaSettings)
    monkeypatch.setenv("AGL_STREAM_SASL_USERNAME", "alice")
    monkeypatch.setenv("AGL_STREAM_SASL_PASSWORD", "hunter2")
    settings = load(KafkaSettings)
    options = settings.client_options()
    assert options["sasl_mechanism"] == "SCRAM-SHA-512"
    assert options["sasl_plain_password"] == "hunter2"
    assert "hunter2" not in repr(settings) and "hunter2" not in str(settings.describe())


def test_database_url_password_is_masked_and_never_echoed_in_errors() -> None:
    settings = load(DatabaseSettings, database_url="postgresql://u:s3cret@db:5432/agl")
    assert settings.display_url() == "postgresql://u:***@db:5432/agl"
    assert settings.sqlalchemy_url.startswith("postgresql+asyncpg://")
    assert "s3cret" not in repr(settings)
    with pytest.raises(ConfigError) as info:
        load(DatabaseSettings, database_url="mysql://u:s3cret@db/agl")
    assert "s3cret" not in str(info.value)
    assert "--database-url / AGL_STREAM_DATABASE_URL" in str(info.value)


def test_stack_home_is_absolute(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    monkeypatch.setenv("AGL_STREAM_HOME", "relative/dir")
    assert load(StackSettings).home.is_absolute()
    monkeypatch.setenv("AGL_STREAM_BROKER_PORT", "70000")
    with pytest.raises(ConfigError, match="--broker-port / AGL_STREAM_BROKER_PORT"):
        load(StackSettings)


def test_the_broker_and_postgres_need_different_ports() -> None:
    with pytest.raises(ConfigError, match="cannot both listen on port 30000"):
        load(StackSettings, broker_port=30000, postgres_port=30000)


def test_the_schema_registry_needs_a_port_of_its_own() -> None:
    with pytest.raises(ConfigError, match="schema registry cannot listen on port 30000"):
        load(StackSettings, broker_port=30000, registry=True, registry_port=30000)
    assert load(StackSettings, broker_port=30000, registry_port=30000).registry is False


def test_a_stack_with_a_registry_tells_clients_its_url() -> None:
    plain = StackState(home="/h", postgres_port=1, cluster_id="c")
    assert "AGL_STREAM_SCHEMA_REGISTRY_URL" not in plain.environment()
    with_registry = StackState.parse(
        '{"home": "/h", "postgres_port": 1, "cluster_id": "c", "nodes": [], '
        '"registry_port": 18081, "registry_pid": null}'
    )
    assert with_registry.environment()["AGL_STREAM_SCHEMA_REGISTRY_URL"] == (
        "http://127.0.0.1:18081/apis/ccompat/v7"
    )
