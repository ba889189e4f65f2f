"""Where integration tests find a real broker and a real PostgreSQL.

embedded: AGL_STREAM_BOOTSTRAP_SERVERS and AGL_STREAM_DATABASE_URL if both are set; otherwise
a private stack the tests start in a temporary home and stop. Never the stack `agl-stream up`
runs in .agl-stream/ unless those variables point at it: the tests create and delete hundreds
of topics, and an embedded broker restarted on storage that has seen that much churn has
been seen to refuse metadata requests (the demo then cannot start on it).
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

from agl_stream.config import StackSettings
from agl_stream.embedded.process import pick_ports
from agl_stream.embedded.stack import EmbeddedStack


@dataclass(frozen=True)
class Backend:
    name: str
    bootstrap_servers: str
    database_url: str
    # How to freeze and thaw the broker (SIGSTOP/SIGCONT, docker pause), where it can be.
    freeze: Callable[[], None] | None = None
    thaw: Callable[[], None] | None = None

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
        StackSettings(home=private_home, broker_port=broker_port, postgres_port=postgres_port)
    )
    state = stack.up()
    try:
        yield Backend(
            "embedded (private)",
            state.bootstrap_servers,
            state.database_url,
            **signals(state.broker_pid),
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
