"""The embedded broker's SASL/SCRAM-over-TLS configuration (pure): the client and
inter-broker listener is SASL_SSL with PEM stores, the controller's stays plaintext, the
brokers log in as the first user, every user's credentials go into the storage format, and
the properties file (which holds a password) is readable by its owner only."""

from __future__ import annotations

import stat
from pathlib import Path

from agl_stream.embedded.kafka_node import (
    BrokerSecurity,
    KafkaNode,
    format_command,
    server_properties,
    write_config,
)

SECURITY = BrokerSecurity(
    keystore=Path("/tls/broker.pem"),
    truststore=Path("/tls/ca.pem"),
    users=(("broker", "b-secret"), ("alice", "a-secret")),
)
NODES = [KafkaNode(1, 9092, 9093, host="198.18.0.11"), KafkaNode(2, 9092, 9093, host="198.18.0.12")]


def properties(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines())


def test_sasl_ssl_listener_and_plaintext_controller() -> None:
    props = properties(server_properties(NODES[0], NODES, Path("/home"), SECURITY))
    assert props["listeners"] == "SASL_SSL://198.18.0.11:9092,CONTROLLER://198.18.0.11:9093"
    assert props["advertised.listeners"] == "SASL_SSL://198.18.0.11:9092"
    assert props["inter.broker.listener.name"] == "SASL_SSL"
    assert props["listener.security.protocol.map"] == "SASL_SSL:SASL_SSL,CONTROLLER:PLAINTEXT"
    assert props["controller.quorum.voters"] == "1@198.18.0.11:9093,2@198.18.0.12:9093"
    assert props["sasl.enabled.mechanisms"] == "SCRAM-SHA-256"
    assert props["sasl.mechanism.inter.broker.protocol"] == "SCRAM-SHA-256"
    assert props["listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config"] == (
        "org.apache.kafka.common.security.scram.ScramLoginModule required "
        'username="broker" password="b-secret";'
    )
    assert props["ssl.keystore.type"] == props["ssl.truststore.type"] == "PEM"


def test_plaintext_without_security() -> None:
    props = properties(server_properties(NODES[0], NODES, Path("/home")))
    assert props["listeners"] == "PLAINTEXT://198.18.0.11:9092,CONTROLLER://198.18.0.11:9093"
    assert not any(key.startswith(("sasl.", "ssl.")) for key in props)


def test_every_user_is_formatted_into_the_storage(tmp_path: Path) -> None:
    command = format_command(NODES[0], tmp_path, "cluster-id", SECURITY)
    assert "--add-scram=SCRAM-SHA-256=[name=broker,password=b-secret]" in command
    assert "--add-scram=SCRAM-SHA-256=[name=alice,password=a-secret]" in command
    assert not any("scram" in a for a in format_command(NODES[0], tmp_path, "cluster-id"))


def test_the_properties_file_is_the_owners_only(tmp_path: Path) -> None:
    path = write_config(NODES[0], NODES, tmp_path, SECURITY)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
