"""Where integration tests find a real broker and a real PostgreSQL.

embedded: AGL_STREAM_BOOTSTRAP_SERVERS and AGL_STREAM_DATABASE_URL if both are set; otherwise
a private stack (one Apache Kafka node, PostgreSQL) the tests start in a temporary home and
stop. Never the stack `agl-stream up` runs in .agl-stream/ unless those variables point at
it: the tests create and delete hundreds of topics and consumer groups of their own.
cluster: a private stack of three Kafka nodes, for the tests that kill brokers.
testcontainers: Apache Kafka and PostgreSQL containers, where a Docker engine runs.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from agl_stream.embedded.process import pick_ports
from agl_stream.embedded.stack import EmbeddedStack
from agl_stream.runtime.config import StackSettings

# The private test broker checks for segments past their retention every 5 s, not every
# minute as `agl-stream up`'s does: the soak test waits for retention to delete old segments
# of its short-lived topics, which a check a minute made it wait for up to 30 s after the
# soak (the other tests' topics keep retention of days or forever: nothing else changes).
TEST_BROKER = {"log.retention.check.interval.ms": 5_000}


@dataclass(frozen=True)
class Backend:
    name: str
    bootstrap_servers: str
    database_url: str
    # How to freeze and thaw the broker (SIGSTOP/SIGCONT, docker pause), where it can be.
    freeze: Callable[[], None] | None = None
    thaw: Callable[[], None] | None = None
    # An embedded stack of several Kafka nodes: nodes can be killed and started again.
    stack: EmbeddedStack | None = None
    replication_factor: int = 1

    @property
    def can_kill_brokers(self) -> bool:
        state = self.stack.state() if self.stack is not None else None
        return state is not None and len(state.nodes) >= 3

    def node_ids(self) -> list[int]:
        assert self.stack is not None
        state = self.stack.state()
        assert state is not None
        return [n.node_id for n in state.nodes]

    async def kill_and_restart_broker(self, node_id: int, down_seconds: float) -> None:
        """kill -9 one Kafka node, leave it down for a while, start it again (with its data)
        and wait until it is back in the cluster."""
        assert self.stack is not None
        self.stack.kill_node(node_id)
        await asyncio.sleep(down_seconds)
        await asyncio.to_thread(self.stack.up)

    async def pause_node(self, node_id: int, seconds: float) -> None:
        assert self.stack is not None
        state = self.stack.state()
        assert state is not None
        pid = state.node(node_id).pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)

    @property
    def can_pause(self) -> bool:
        return self.freeze is not None and self.thaw is not None

    async def pause_broker(self, seconds: float) -> None:
        """The broker stops answering for `seconds` (its connections stay open), then goes on."""
        if self.freeze is None or self.thaw is None:
            raise RuntimeError(f"the {self.name} backend cannot pause its broker")
        self.freeze()
        try:
            await asyncio.sleep(seconds)
        finally:
            self.thaw()


def signals(pid: int | None) -> dict[str, Callable[[], None]]:
    if pid is None:
        return {}
    return {
        "freeze": lambda: os.kill(pid, signal.SIGSTOP),
        "thaw": lambda: os.kill(pid, signal.SIGCONT),
    }


@contextmanager
def embedded(private_home: Path) -> Iterator[Backend]:
    servers = os.environ.get("AGL_STREAM_BOOTSTRAP_SERVERS")
    url = os.environ.get("AGL_STREAM_DATABASE_URL")
    if servers and url:
        yield Backend("embedded", servers, url)
        return
    broker_port, postgres_port = pick_ports(2, 32_000, 32_700)
    stack = EmbeddedStack(
        StackSettings(home=private_home, broker_port=broker_port, postgres_port=postgres_port),
        broker_overrides=TEST_BROKER,
    )
    state = stack.up()
    try:
        yield Backend(
            "embedded (private)",
            state.bootstrap_servers,
            state.database_url,
            **signals(state.broker_pid),
            stack=stack,
        )
    finally:
        stack.down()


@contextmanager
def cluster(private_home: Path, nodes: int = 3) -> Iterator[Backend]:
    """Three Kafka nodes (KRaft, each broker and controller) on loopback and PostgreSQL;
    topics replicated three times with two in sync."""
    broker_port, postgres_port = pick_ports(2, 32_000, 32_700)
    stack = EmbeddedStack(
        StackSettings(
            home=private_home, broker_port=broker_port, postgres_port=postgres_port,
            kafka_nodes=nodes,
        )
    )  # fmt: skip
    state = stack.up()
    try:
        yield Backend(
            f"embedded cluster ({nodes} nodes)",
            state.bootstrap_servers,
            state.database_url,
            stack=stack,
            replication_factor=min(3, nodes),
        )
    finally:
        stack.down()


def docker_available() -> str | None:
    """None when a Docker engine answers, else why not."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if host.startswith("unix://") and not Path(host.removeprefix("unix://")).exists():
        return f"no Docker engine (no socket at {host})"
    import docker

    try:
        client = docker.from_env(timeout=3)
    except Exception as exc:  # noqa: BLE001 - any failure means no engine here
        return f"no Docker engine ({type(exc).__name__})"
    try:
        client.ping()
    except Exception as exc:  # noqa: BLE001
        return f"no Docker engine answers at {host} ({type(exc).__name__})"
    finally:
        client.close()
    return None


@contextmanager
def testcontainers() -> Iterator[Backend]:
    from testcontainers.kafka import KafkaContainer
    from testcontainers.postgres import PostgresContainer

    with (
        KafkaContainer("confluentinc/cp-kafka:7.6.1") as kafka,
        PostgresContainer("postgres:16", driver=None) as pg,
    ):
        container = kafka.get_wrapped_container()
        yield Backend(
            "testcontainers",
            kafka.get_bootstrap_server(),
            pg.get_connection_url(),
            freeze=container.pause,
            thaw=container.unpause,
        )
