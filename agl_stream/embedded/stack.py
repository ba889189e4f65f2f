"""`agl-stream up` / `down`: a broker, its S3 storage and PostgreSQL, as background
processes under one home directory, found again by the next command."""

from __future__ import annotations

import fcntl
import json
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from agl_stream.config import StackSettings
from agl_stream.embedded import broker, postgres, seaweed
from agl_stream.embedded.process import StackError, alive, pick_port, port_free, port_open
from agl_stream.embedded.seaweed import SeaweedPorts

STATE_FILE = "stack.json"


@dataclass(frozen=True)
class StackState:
    home: str
    broker_port: int
    broker_pid: int | None
    postgres_port: int
    seaweed_pid: int | None
    seaweed_ports: dict[str, int]

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.broker_port}"

    @property
    def database_url(self) -> str:
        return f"postgresql://{postgres.SUPERUSER}@127.0.0.1:{self.postgres_port}/agl_stream"

    def environment(self) -> dict[str, str]:
        return {
            "AGL_STREAM_BOOTSTRAP_SERVERS": self.bootstrap_servers,
            "AGL_STREAM_DATABASE_URL": self.database_url,
        }


class EmbeddedStack:
    def __init__(self, settings: StackSettings) -> None:
        self.settings = settings
        self.home = settings.home

    @property
    def state_path(self) -> Path:
        return self.home / STATE_FILE

    def state(self) -> StackState | None:
        try:
            return StackState(**json.loads(self.state_path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def running(self) -> StackState | None:
        """The state of a stack whose processes are all up, else None."""
        state = self.state()
        if state is None:
            return None
        ok = (
            alive(state.seaweed_pid, "weed")
            and alive(state.broker_pid, "tansu")
            and port_open(state.broker_port)
            and port_open(state.postgres_port)
        )
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

    def _secret(self) -> str:
        path = self.home / "s3.secret"
        if not path.exists():
            path.write_text(secrets.token_hex(16))
            path.chmod(0o600)
        return path.read_text().strip()

    def _seaweed_ports(self, previous: StackState | None) -> SeaweedPorts:
        if previous is None:
            return _fresh_seaweed_ports(
                avoid={self.settings.broker_port, self.settings.postgres_port}
            )
        # SeaweedFS records its servers' addresses in its data: keep the ports it had.
        ports = SeaweedPorts(**previous.seaweed_ports)
        for port in (ports.master, ports.volume, ports.filer, ports.s3):
            for wanted in (port, ports.grpc(port)):
                if not port_free(wanted):
                    raise StackError(
                        f"port {wanted}, which this stack's storage uses, is taken by another "
                        f"process; free it, or remove {self.home} to start over without its data"
                    )
        return ports

    def up(self) -> StackState:
        """Start whatever is not running; data from earlier runs is kept. Idempotent.
        If a part fails to start, the parts this call started are stopped again."""
        with self._locked():
            previous = self.state()
            undo: list[Callable[[], None]] = []
            try:
                return self._up(previous, undo)
            except BaseException:
                for action in reversed(undo):
                    action()
                raise

    def _up(self, previous: StackState | None, undo: list[Callable[[], None]]) -> StackState:
        secret = self._secret()
        if previous is not None and alive(previous.seaweed_pid, "weed"):
            ports = SeaweedPorts(**previous.seaweed_ports)
            seaweed_pid = previous.seaweed_pid
        else:
            ports = self._seaweed_ports(previous)
            seaweed_pid = seaweed.start(self.home, ports, secret)
            undo.append(lambda: seaweed.stop_server(seaweed_pid))
        if previous is not None and alive(previous.broker_pid, "tansu"):
            broker_pid, broker_port = previous.broker_pid, previous.broker_port
        else:
            broker_port = self.settings.broker_port
            broker_pid = broker.start(self.home, broker_port, ports.s3, secret)
            undo.append(lambda: broker.stop_broker(broker_pid))
        if postgres.running(self.home) and previous is not None:
            postgres_port = previous.postgres_port
        else:
            postgres_port = self.settings.postgres_port
            undo.append(lambda: postgres.stop(self.home))
            postgres.start(self.home, postgres_port)
        state = StackState(
            home=str(self.home),
            broker_port=broker_port,
            broker_pid=broker_pid,
            postgres_port=postgres_port,
            seaweed_pid=seaweed_pid,
            seaweed_ports={k: v for k, v in asdict(ports).items() if k != "grpc_offset"},
        )
        self.state_path.write_text(json.dumps(asdict(state), indent=2))
        (self.home / "env").write_text(
            "".join(f"export {k}={v}\n" for k, v in state.environment().items())
        )
        return state

    def down(self) -> bool:
        """Stop everything; False when nothing was running. Data stays for the next `up`."""
        with self._locked():
            state = self.state()
            was_running = bool(
                state and (alive(state.broker_pid) or alive(state.seaweed_pid))
            ) or postgres.running(self.home)
            if state is not None:
                # The broker first, so nothing is mid-write when its storage goes away.
                broker.stop_broker(state.broker_pid)
                seaweed.stop_server(state.seaweed_pid)
            postgres.stop(self.home)
            return was_running


def _fresh_seaweed_ports(avoid: set[int]) -> SeaweedPorts:
    # Below the kernel's ephemeral range (32768+), gRPC ports included, so that a client
    # socket never sits on a port SeaweedFS wants after a restart.
    picked: set[int] = set()
    while len(picked) < 4:
        port = pick_port(10_000, 22_000)
        taken = picked | avoid
        if port not in taken and port + 10_000 not in avoid and port_free(port + 10_000):
            picked.add(port)
    master, volume, filer, s3 = sorted(picked)
    return SeaweedPorts(master=master, volume=volume, filer=filer, s3=s3)
