"""Starting, finding and stopping the stack's background processes."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


class StackError(RuntimeError):
    """The embedded stack could not do what was asked; the message says what and where to look."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pick_port(low: int, high: int, attempts: int = 200) -> int:
    """A free port in [low, high); raises StackError when none is found."""
    for _ in range(attempts):
        port = random.randrange(low, high)
        if port_free(port):
            return port
    raise StackError(f"no free port between {low} and {high}")


def pick_ports(count: int, low: int, high: int) -> list[int]:
    """`count` different free ports in [low, high)."""
    picked: list[int] = []
    while len(picked) < count:
        port = pick_port(low, high)
        if port not in picked:
            picked.append(port)
    return picked


def port_free(port: int) -> bool:
    """Whether a server could listen on the port now. SO_REUSEADDR, as servers set it, so a
    port whose old connections linger in TIME_WAIT counts as free."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


def spawn(argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None) -> int:
    """Start a daemon in a session of its own (Ctrl-C of the CLI does not reach it), output
    appended to `log`. posix_spawn, not Popen: the daemon outlives this process by design."""
    log.parent.mkdir(parents=True, exist_ok=True)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    try:
        return os.posix_spawn(
            argv[0],
            list(argv),
            {**os.environ, **(env or {})},
            file_actions=[
                (os.POSIX_SPAWN_DUP2, devnull, 0),
                (os.POSIX_SPAWN_DUP2, out, 1),
                (os.POSIX_SPAWN_DUP2, out, 2),
            ],
            setsid=True,
        )
    finally:
        os.close(out)
        os.close(devnull)


def alive(pid: int | None, executable: str | None = None) -> bool:
    """Whether pid runs, and (when given) runs a program whose name contains `executable`."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    if stat.split(") ", 1)[-1].startswith("Z"):
        _reap(pid)
        return False
    if executable is None:
        return True
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return True
    return executable in cmdline


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):  # not our child: init reaps it
        os.waitpid(pid, os.WNOHANG)


def stop(pid: int | None, grace_seconds: float, executable: str | None = None) -> None:
    """SIGTERM, then SIGKILL after the grace period."""
    if not alive(pid, executable):
        return
    assert pid is not None
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    while alive(pid):
        time.sleep(0.05)


def wait_until(check: object, timeout: float, what: str, log: Path | None = None) -> None:
    """Poll check() until true; on timeout raise StackError pointing at the log."""
    assert callable(check)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    where = f"; see {log}" if log else ""
    raise StackError(f"{what} did not come up within {timeout:.0f} s{where}")


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
