"""One Apache Kafka node in KRaft mode (broker and controller in one JVM), as a background
process; several of them, on loopback, make a cluster."""

from __future__ import annotations

import os
import re
import socket
import struct
import subprocess
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from agl_stream.embedded import kafka_dist
from agl_stream.embedded.process import (
    StackError,
    alive,
    port_open,
    spawn,
    stop,
    tail,
    wait_until,
)

# Sized for a 2-core, 24 GiB machine that also runs PostgreSQL, workers and a trainer: a
# fixed 1 GiB heap (Kafka keeps records in the page cache, not the heap), G1 with short
# pauses, and a JVM that exits on OutOfMemoryError instead of limping on.
JVM_OPTIONS = (
    "-Xms1g", "-Xmx1g",
    "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent", "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)  # fmt: skip


@dataclass(frozen=True)
class KafkaNode:
    node_id: int
    port: int  # clients
    controller_port: int  # the KRaft quorum
    host: str = "127.0.0.1"  # the address it listens on and advertises

    def data_dir(self, home: Path) -> Path:
        return home / "kafka" / f"node-{self.node_id}"

    def log(self, home: Path) -> Path:
        return home / "logs" / f"kafka-{self.node_id}.log"


@dataclass(frozen=True)
class BrokerSecurity:
    """SASL/SCRAM over TLS on the listener clients and brokers use (the KRaft controller
    listener stays plaintext). SCRAM credentials are written into the storage when it is
    formatted; brokers authenticate to each other as the first user."""

    keystore: Path  # PEM: the broker's private key (unencrypted PKCS#8) and certificate
    truststore: Path  # PEM: the CA that signed it, which clients trust too
    users: tuple[tuple[str, str], ...]  # (name, password); the first is the brokers' own
    mechanism: str = "SCRAM-SHA-256"

    def jaas(self) -> str:
        name, password = self.users[0]
        return (
            "org.apache.kafka.common.security.scram.ScramLoginModule required "
            f'username="{name}" password="{password}";'
        )


def server_properties(
    node: KafkaNode,
    cluster: Sequence[KafkaNode],
    home: Path,
    security: BrokerSecurity | None = None,
    overrides: Mapping[str, object] | None = None,
) -> str:
    """The node's server.properties (pure). Internal topics are replicated as widely as the
    cluster allows, up to 3 with two in sync. `overrides` set further broker properties, or
    replace these (a test's broker with shorter timers)."""
    size = len(cluster)
    replicas = min(3, size)
    in_sync = min(2, replicas)
    voters = ",".join(f"{n.node_id}@{n.host}:{n.controller_port}" for n in cluster)
    listener = "PLAINTEXT" if security is None else "SASL_SSL"
    settings: dict[str, object] = {
        "process.roles": "broker,controller",
        "node.id": node.node_id,
        "controller.quorum.voters": voters,
        "listeners": f"{listener}://{node.host}:{node.port},CONTROLLER://{node.host}:{node.controller_port}",
        "advertised.listeners": f"{listener}://{node.host}:{node.port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": listener,
        "listener.security.protocol.map": f"{listener}:{listener},CONTROLLER:PLAINTEXT",
        "log.dirs": node.data_dir(home),
        "offsets.topic.replication.factor": replicas,
        "offsets.topic.num.partitions": 10,
        "transaction.state.log.replication.factor": replicas,
        "transaction.state.log.min.isr": in_sync,
        "transaction.state.log.num.partitions": 10,
        "default.replication.factor": replicas,
        "min.insync.replicas": in_sync,
        # Topics come from `agl-stream topics apply`; a typo must not create one.
        "auto.create.topics.enable": "false",
        # A group forms as soon as its first member joins (tests and the demo start workers
        # one after another; the 3 s default only delays the first assignment).
        "group.initial.rebalance.delay.ms": 0,
        "num.network.threads": 2,
        "num.io.threads": 4,
        "background.threads": 4,
        "num.recovery.threads.per.data.dir": 2,
        "unclean.leader.election.enable": "false",
        # A topic given a short retention (a soak run, a scratch deployment) loses its old
        # segments within a minute, not the default five.
        "log.retention.check.interval.ms": 60_000,
    }
    if security is not None:
        mechanism = security.mechanism.lower()
        settings |= {
            "sasl.enabled.mechanisms": security.mechanism,
            "sasl.mechanism.inter.broker.protocol": security.mechanism,
            f"listener.name.sasl_ssl.{mechanism}.sasl.jaas.config": security.jaas(),
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": security.keystore,
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": security.truststore,
        }
    for key, value in (overrides or {}).items():
        if not re.fullmatch(r"[A-Za-z0-9._-]+", key) or "\n" in str(value) or str(value) == "":
            raise StackError(
                f"broker property override {key!r}={value!r}: expected a property name "
                "(letters, digits, '.', '_', '-') and a one-line, non-empty value"
            )
        settings[key] = value
    return "".join(f"{key}={value}\n" for key, value in settings.items())


def _config_path(node: KafkaNode, home: Path) -> Path:
    return home / "kafka" / f"node-{node.node_id}.properties"


def write_config(
    node: KafkaNode,
    cluster: Sequence[KafkaNode],
    home: Path,
    security: BrokerSecurity | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Path:
    path = _config_path(node, home)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Owner-only: with security it holds the brokers' SCRAM password.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(server_properties(node, cluster, home, security, overrides))
    return path


def formatted(node: KafkaNode, home: Path) -> bool:
    return (node.data_dir(home) / "meta.properties").exists()


def format_command(
    node: KafkaNode, home: Path, cluster_id: str, security: BrokerSecurity | None = None
) -> list[str]:
    libs = kafka_dist.lib_dir()
    scram = (
        [f"--add-scram={security.mechanism}=[name={n},password={p}]" for n, p in security.users]
        if security is not None
        else []
    )
    return [
        str(kafka_dist.java_binary()), f"-Dlog4j2.configurationFile={kafka_dist.LOG4J_CONFIG}",
        "-cp", kafka_dist.classpath(libs), "kafka.tools.StorageTool", "format",
        # One argument: an id may begin with "-" (1 in 64), which a separate one would not be.
        f"--cluster-id={cluster_id}", "--config", str(_config_path(node, home)),
        "--ignore-formatted", *scram,
    ]  # fmt: skip


def format_storage(
    nodes: Sequence[KafkaNode], home: Path, cluster_id: str, security: BrokerSecurity | None = None
) -> None:
    """Format the nodes that have no storage yet (in parallel: each is a JVM start)."""
    pending = [n for n in nodes if not formatted(n, home)]
    running = [
        (n, subprocess.Popen(format_command(n, home, cluster_id, security),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        for n in pending
    ]  # fmt: skip
    for node, process in running:
        output, _ = process.communicate(timeout=120)
        if process.returncode != 0:
            raise StackError(
                f"formatting Kafka node {node.node_id}'s storage failed: {output.strip()[-500:]}"
            )


def start(node: KafkaNode, home: Path, prefix: Sequence[str] = ()) -> int:
    """Start the node's JVM; `prefix` wraps the command (`ip netns exec HOST` puts the node
    on a test host of its own)."""
    libs = kafka_dist.lib_dir()
    argv = [
        *prefix, str(kafka_dist.java_binary()), *JVM_OPTIONS,
        f"-Dlog4j2.configurationFile={kafka_dist.LOG4J_CONFIG}",
        f"-Dkafka.logs.dir={home / 'logs'}",
        "-cp", kafka_dist.classpath(libs), "kafka.Kafka", str(_config_path(node, home)),
    ]  # fmt: skip
    return spawn(argv, node.log(home))


def wait_ready(
    pids: dict[int, int], nodes: Sequence[KafkaNode], home: Path, secured: bool = False
) -> None:
    """Until every node serves Kafka requests and sees the whole cluster (a secured node:
    until its log says it started); StackError if one exits meanwhile (with the end of its
    log) or it takes over 90 s."""
    for node in nodes:
        pid = pids[node.node_id]
        log = node.log(home)

        def ready(node: KafkaNode = node, log: Path = log) -> bool:
            if secured:
                return port_open(node.port, node.host) and _STARTED in tail(log, 400)
            return brokers_seen(node.port, node.host) == len(nodes)

        wait_until(
            lambda pid=pid, ready=ready: ready() or not alive(pid),
            90, f"Kafka node {node.node_id}", log,
        )  # fmt: skip
        if not alive(pid):
            raise StackError(
                f"Kafka node {node.node_id} exited at start (is port {node.port} or "
                f"{node.controller_port} taken?); the end of {log}:\n{tail(log, 8)}"
            )


_STARTED = "Kafka Server started"


def brokers_seen(port: int, host: str = "127.0.0.1") -> int:
    """How many brokers a Metadata request to this port lists (0 when it does not answer:
    a starting node listens before it serves)."""
    # Metadata v4: all topics (null array), no auto-creation; header v1.
    request = struct.pack(">hhih", 3, 4, 7, 3) + b"agl" + struct.pack(">ib", -1, 0)
    try:
        with socket.create_connection((host, port), timeout=5) as sock:
            sock.sendall(struct.pack(">i", len(request)) + request)
            head = _read(sock, 4)
            body = _read(sock, struct.unpack(">i", head)[0])
    except (OSError, struct.error):
        return 0
    correlation, _throttle, brokers = struct.unpack(">iii", body[:12])
    return brokers if correlation == 7 else 0


def _read(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise OSError("connection closed")
        data += chunk
    return data


_ACTIVE = re.compile(r"\[QuorumController id=(\d+)\] Becoming the active controller at epoch (\d+)")


def active_controller(nodes: Sequence[KafkaNode], home: Path) -> int | None:
    """The node that became the active controller at the highest epoch, from the nodes'
    logs (the Kafka protocol has no request for it that aiokafka speaks)."""
    best: tuple[int, int] | None = None
    for node in nodes:
        try:
            text = node.log(home).read_text(errors="replace")
        except OSError:
            continue
        for match in _ACTIVE.finditer(text):
            epoch, node_id = int(match[2]), int(match[1])
            if best is None or epoch > best[0]:
                best = (epoch, node_id)
    return None if best is None else best[1]


def stop_node(pid: int | None) -> None:
    # A controlled shutdown moves partition leadership away first; 30 s covers it here.
    stop(pid, grace_seconds=30, executable="java")


def stop_nodes(pids: Sequence[int | None]) -> None:
    """Stop a cluster's nodes together: one at a time, the last ones would wait for a
    controller quorum that is already gone."""
    with ThreadPoolExecutor(max_workers=max(1, len(pids))) as pool:
        list(pool.map(stop_node, pids))
