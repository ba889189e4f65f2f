"""`agl-stream up` / `down`: Apache Kafka (KRaft, one node or a small cluster on loopback)
and PostgreSQL, as background processes under one home directory, found again by the next
command."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from agl_stream.embedded import kafka_dist, kafka_node, postgres, registry_dist
from agl_stream.embedded.kafka_node import BrokerSecurity, KafkaNode
from agl_stream.embedded.process import (
    StackError,
    alive,
    pick_port,
    port_free,
    port_open,
    stop,
)
from agl_stream.runtime.config import StackSettings

STATE_FILE = "stack.json"
BROKER = f"Apache Kafka {kafka_dist.KAFKA_VERSION}"


@dataclass(frozen=True)
class NodeState:
    node_id: int
    port: int
    controller_port: int
    pid: int | None = None

    @property
    def node(self) -> KafkaNode:
        return KafkaNode(self.node_id, self.port, self.controller_port)

    def running(self) -> bool:
        return alive(self.pid, "java") and port_open(self.port)


@dataclass(frozen=True)
class StackState:
    home: str
    postgres_port: int
    cluster_id: str
    nodes: tuple[NodeState, ...] = field(default_factory=tuple)
    broker: str = BROKER
    registry_port: int | None = None  # a schema registry runs when set (`up --registry`)
    registry_pid: int | None = None

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    @property
    def broker_pid(self) -> int | None:
        """The first node's process (the only one of a one-node stack)."""
        return self.nodes[0].pid if self.nodes else None

    @property
    def broker_pids(self) -> list[int]:
        return [n.pid for n in self.nodes if n.pid]

    @property
    def database_url(self) -> str:
        return f"postgresql://{postgres.SUPERUSER}@127.0.0.1:{self.postgres_port}/agl_stream"

    @property
    def registry_url(self) -> str | None:
        return None if self.registry_port is None else registry_dist.url(self.registry_port)

    def registry_running(self) -> bool:
        return (
            self.registry_port is not None
            and alive(self.registry_pid, "java")
            and registry_dist.answers(self.registry_port)
        )

    def environment(self) -> dict[str, str]:
        env = {
            "AGL_STREAM_BOOTSTRAP_SERVERS": self.bootstrap_servers,
            "AGL_STREAM_DATABASE_URL": self.database_url,
        }
        if self.registry_url is not None:
            env["AGL_STREAM_SCHEMA_REGISTRY_URL"] = self.registry_url
        return env

    def node(self, node_id: int) -> NodeState:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise KeyError(node_id)

    @staticmethod
    def parse(text: str) -> StackState:
        raw = json.loads(text)
        raw["nodes"] = tuple(NodeState(**n) for n in raw["nodes"])
        return StackState(**raw)


class EmbeddedStack:
    def __init__(
        self,
        settings: StackSettings,
        security: BrokerSecurity | None = None,
        broker_overrides: Mapping[str, object] | None = None,
    ) -> None:
        self.settings = settings
        self.home = settings.home
        self.security = security  # SASL/SCRAM over TLS (a test's; `up` runs plaintext)
        # Further server.properties of every node (a test's shorter broker timers).
        self.broker_overrides = dict(broker_overrides or {})

    @property
    def state_path(self) -> Path:
        return self.home / STATE_FILE

    def state(self) -> StackState | None:
        try:
            return StackState.parse(self.state_path.read_text())
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def running(self) -> StackState | None:
        """The state of a stack whose processes are all up, else None."""
        state = self.state()
        if state is None or not state.nodes:
            return None
        ok = all(n.running() for n in state.nodes) and port_open(state.postgres_port)
        return state if ok else None

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.home.mkdir(parents=True, exist_ok=True)
        with (self.home / ".lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def up(self) -> StackState:
        """Start whatever is not running; data from earlier runs is kept. Idempotent.
        If a part fails to start, the parts this call started are stopped again."""
        kafka_dist.install()
        kafka_dist.java_binary()
        if self.settings.registry:
            registry_dist.install()
        with self._locked():
            previous = self.state()
            undo: list[Callable[[], None]] = []
            try:
                return self._up(previous, undo)
            except BaseException:
                for action in reversed(undo):
                    action()
                raise

    def _layout(self, previous: StackState | None) -> tuple[str, list[NodeState]]:
        """The cluster id and the nodes' ports: those of the data here, else new ones."""
        if previous is not None and len(previous.nodes) == self.settings.kafka_nodes:
            return previous.cluster_id, list(previous.nodes)
        if (self.home / "kafka").exists():
            raise StackError(
                f"{self.home} holds a Kafka cluster of another size than the "
                f"{self.settings.kafka_nodes} node(s) asked for (or its stack.json is gone); "
                f"remove {self.home / 'kafka'} to start over without its data"
            )
        avoid = {self.settings.broker_port, self.settings.postgres_port}
        ports = [self.settings.broker_port]
        while len(ports) < 2 * self.settings.kafka_nodes:
            port = pick_port(20_000, 32_000)
            if port not in avoid and port not in ports:
                ports.append(port)
        count = self.settings.kafka_nodes
        client_ports, controller_ports = ports[:count], ports[count:]
        nodes = [
            NodeState(node_id=i + 1, port=client_ports[i], controller_port=controller_ports[i])
            for i in range(count)
        ]
        cluster_id = uuid.uuid4().bytes
        return _kafka_id(cluster_id), nodes

    def _up(self, previous: StackState | None, undo: list[Callable[[], None]]) -> StackState:
        cluster_id, nodes = self._layout(previous)
        cluster = [n.node for n in nodes]
        to_start = [n for n in nodes if not n.running()]
        for stopped in to_start:
            for port in (stopped.port, stopped.controller_port):
                if not port_free(port):
                    raise StackError(
                        f"port {port}, which Kafka node {stopped.node_id} of this stack uses, is "
                        f"taken by another process; free it (or `agl-stream down` the stack "
                        f"that holds it), or remove {self.home} to start over without its data"
                    )
        for node in cluster:
            kafka_node.write_config(node, cluster, self.home, self.security, self.broker_overrides)
        kafka_node.format_storage(cluster, self.home, cluster_id, self.security)
        pids = {n.node_id: n.pid for n in nodes if n.pid}
        for stopped in to_start:
            pid = kafka_node.start(stopped.node, self.home)
            pids[stopped.node_id] = pid
            undo.append(lambda pid=pid: kafka_node.stop_node(pid))  # type: ignore[misc]
        nodes = [replace(n, pid=pids[n.node_id]) for n in nodes]
        kafka_node.wait_ready(
            {n.node_id: pids[n.node_id] or 0 for n in nodes},
            cluster,
            self.home,
            secured=self.security is not None,
        )
        if postgres.running(self.home) and previous is not None:
            postgres_port = previous.postgres_port
        else:
            postgres_port = self.settings.postgres_port
            undo.append(lambda: postgres.stop(self.home))
            postgres.start(self.home, postgres_port)
        registry_port, registry_pid = self._registry(previous, undo)
        state = StackState(
            home=str(self.home),
            postgres_port=postgres_port,
            cluster_id=cluster_id,
            nodes=tuple(nodes),
            registry_port=registry_port,
            registry_pid=registry_pid,
        )
        self._save(state)
        return state

    def _registry(
        self, previous: StackState | None, undo: list[Callable[[], None]]
    ) -> tuple[int | None, int | None]:
        """The schema registry's port and pid: the running one, else one started now (its
        data under home/registry), when it is asked for or ran before (on the port it had:
        clients were told that URL)."""
        if previous is not None and previous.registry_running():
            return previous.registry_port, previous.registry_pid
        earlier = previous.registry_port if previous is not None else None
        if not self.settings.registry and earlier is None:
            return None, None
        port = earlier or self.settings.registry_port
        if not port_free(port):
            raise StackError(
                f"port {port}, which the schema registry would use, is taken by another "
                "process; free it or give another with --registry-port"
            )
        pid = registry_dist.start(port, self.home / "registry.log", self.home / "registry")
        undo.append(lambda: stop(pid, 10.0, "java"))
        return port, pid

    def _save(self, state: StackState) -> None:
        raw = asdict(state)
        self.state_path.write_text(json.dumps(raw, indent=2))
        (self.home / "env").write_text(
            "".join(f"export {k}={v}\n" for k, v in state.environment().items())
        )

    def kill_node(self, node_id: int) -> None:
        """SIGKILL one Kafka node (fault injection); `up` starts it again with its data."""
        state = self.state()
        if state is None:
            raise StackError(f"no stack under {self.home}")
        pid = state.node(node_id).pid
        if alive(pid, "java"):
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            while alive(pid):
                time.sleep(0.01)

    def active_controller(self) -> int | None:
        """The node id of the KRaft quorum's active controller (from the nodes' logs)."""
        state = self.state()
        if state is None:
            return None
        return kafka_node.active_controller([n.node for n in state.nodes], self.home)

    def down(self) -> bool:
        """Stop everything; False when nothing was running. Data stays for the next `up`."""
        with self._locked():
            state = self.state()
            was_running = bool(state and any(alive(n.pid) for n in state.nodes))
            was_running = postgres.running(self.home) or was_running
            if state is not None:
                was_running = was_running or alive(state.registry_pid, "java")
                stop(state.registry_pid, 10.0, "java")
                kafka_node.stop_nodes([n.pid for n in state.nodes])
            postgres.stop(self.home)
            return was_running


def _kafka_id(raw: bytes) -> str:
    """A cluster id as Kafka writes one: 16 bytes, URL-safe base64 without padding."""
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")
