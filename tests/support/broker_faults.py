"""A private embedded stack (one Kafka node and PostgreSQL, ports of its own) whose Kafka node
keeps its log on a small disk of its own (a tmpfs: root only), which a test can fill."""

from __future__ import annotations

import subprocess
from pathlib import Path

from agl_stream.embedded.process import free_port
from agl_stream.embedded.stack import EmbeddedStack, StackState
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings, StackSettings, load
from tests.support.postgres_faults import FILLER, fill_disk, mount_tmpfs

# Shorter broker timers than the defaults, which a restart after the halt waits out: the
# controller (in the halted JVM too) takes the node's old registration for alive until its
# session times out (9 s), and a transaction the halt left open is aborted at the next
# check for timed-out ones (every 10 s). Four missed heartbeats still fence a node.
FAST_RECOVERY = {
    "broker.heartbeat.interval.ms": 1_000,
    "broker.session.timeout.ms": 4_000,
    "transaction.abort.timed.out.transaction.cleanup.interval.ms": 1_000,
}


class SmallDiskStack:
    def __init__(self, home: Path, disk_mb: int) -> None:
        self.home = home
        self.disk_mb = disk_mb
        # The node's only log directory, a tmpfs beside the stack's home (the stack makes
        # home/kafka itself on its first start), formatted there by that start.
        self.disk = home.parent / f"{home.name}-broker-disk"
        settings = load(
            StackSettings, home=home, broker_port=free_port(), postgres_port=free_port()
        )
        overrides = {**FAST_RECOVERY, "log.dirs": self.disk}
        self.stack = EmbeddedStack(settings, broker_overrides=overrides)
        self._mounted = False

    def up(self) -> StackState:
        """Start it; the first time, on a tmpfs mounted for the node's log directory."""
        if not self._mounted:
            mount_tmpfs(self.disk, self.disk_mb)
            self._mounted = True
        return self.stack.up()

    def settings(self, **kafka: object) -> tuple[KafkaSettings, DatabaseSettings]:
        state = self.stack.running()
        assert state is not None, "the stack is not running"
        return (
            load(KafkaSettings, bootstrap_servers=state.bootstrap_servers, **kafka),
            load(DatabaseSettings, database_url=state.database_url),
        )

    def broker_running(self) -> bool:
        state = self.stack.state()
        return state is not None and all(n.running() for n in state.nodes)

    def fill(self, leave_bytes: int) -> None:
        fill_disk(self.disk, leave_bytes)

    def free(self) -> None:
        (self.disk / FILLER).unlink(missing_ok=True)

    def down(self) -> None:
        self.stack.down()
        if self._mounted:
            subprocess.run(["umount", "--lazy", str(self.disk)], check=False)
            self._mounted = False
