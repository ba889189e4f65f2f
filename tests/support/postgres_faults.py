"""A private PostgreSQL (the embedded stack's binaries, its own data directory and port) that a
test can kill -9, keep down, or give a small disk of its own (a tmpfs, root only) and fill:
the shared test stack's database is never touched."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from agl_stream.embedded import postgres
from agl_stream.embedded.process import free_port
from agl_stream.runtime.config import DatabaseSettings, load


class DiskUnavailable(Exception):
    """No small disk can be made here (not root, or no tmpfs)."""


class KillablePostgres:
    def __init__(self, home: Path, disk_mb: int | None = None) -> None:
        """`disk_mb`: the data directory on a tmpfs of this size (DiskUnavailable unless
        this process may mount one)."""
        self.home = home
        self.port = free_port()
        self.kills = 0
        self.disk_mb = disk_mb
        self._mounted = False

    @property
    def data(self) -> Path:
        return self.home / "postgres"

    def _mount(self) -> None:
        if self.disk_mb is None or self._mounted:
            return
        mount_tmpfs(self.data, self.disk_mb)
        self._mounted = True

    def fill(self, leave_bytes: int) -> None:
        fill_disk(self.data, leave_bytes)

    def free(self) -> None:
        (self.data / FILLER).unlink(missing_ok=True)

    def running(self) -> bool:
        return postgres.running(self.home)

    @property
    def settings(self) -> DatabaseSettings:
        url = f"postgresql://{postgres.SUPERUSER}@127.0.0.1:{self.port}/agl_stream"
        return load(DatabaseSettings, database_url=url)

    def start(self) -> None:
        self._mount()
        postgres.start(self.home, self.port)

    def stop(self) -> None:
        postgres.stop(self.home)
        if self._mounted:
            subprocess.run(["umount", "--lazy", str(self.data)], check=False)
            self._mounted = False

    def processes(self) -> list[int]:
        """The postmaster and every process it started."""
        pid_file = self.home / "postgres" / "postmaster.pid"
        if not pid_file.exists():
            return []
        master = int(pid_file.read_text().split()[0])
        return [master, *_children(master)]

    async def kill(self) -> None:
        await asyncio.to_thread(self._kill)

    def _kill(self) -> None:
        """SIGKILL the server and all its processes, as the OOM killer or a lost host would:
        the next start recovers from the write-ahead log."""
        pids = self.processes()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids):
            if time.monotonic() > deadline:
                raise AssertionError(f"PostgreSQL's processes {pids} outlived SIGKILL")
            time.sleep(0.05)
        # A dead postmaster that nobody has reaped yet still holds its pid, and PostgreSQL
        # refuses to start over a lock file whose pid exists: once all are dead, the lock is
        # stale (the shared memory's attach count is what protects the data, and it is 0).
        deadline = time.monotonic() + 3
        while pids and Path(f"/proc/{pids[0]}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if pids and Path(f"/proc/{pids[0]}").exists():
            (self.home / "postgres" / "postmaster.pid").unlink(missing_ok=True)
        self.kills += 1

    async def restart(self) -> None:
        await asyncio.to_thread(self.start)


FILLER = "filler"


def mount_tmpfs(directory: Path, size_mb: int) -> None:
    """A tmpfs of `size_mb` on `directory` (made if missing); DiskUnavailable where this
    process may not mount one."""
    directory.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(directory)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if mounted.returncode != 0:
        raise DiskUnavailable(f"cannot mount a tmpfs: {mounted.stderr.strip()}")


def fill_disk(directory: Path, leave_bytes: int) -> None:
    """Take the free space of `directory`'s disk but `leave_bytes`, with a file of its own."""
    free = shutil.disk_usage(directory).free
    with (directory / FILLER).open("wb") as out:
        left = free - leave_bytes
        while left > 0:
            out.write(bytes(min(left, 1 << 20)))
            left -= 1 << 20


def _children(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == parent:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] != "Z"
