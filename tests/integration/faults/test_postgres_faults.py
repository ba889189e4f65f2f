"""PostgreSQL killed (-9, every process of it) several times while events flow, then down for a
while: the projector rides it out (never exits, says what it waits for), loses and doubles
nothing (the read model equals a replay of the topics afterwards), and catches up; the
dashboard answers 503 with the reason while the database is away and 200 after, on the same
connection pool. The database is a private PostgreSQL of this test, never the shared one.

Also its disk filled (a tmpfs of its own: root only) while events flow, and freed a while
later: the projector waits, saying the disk is full, and then catches up, equal to a replay.

Size: --faults-size ci (2 kills, 10 s down, 10 s full; the default) or long (10 kills, 2
minutes down, 2 minutes full: `make faults`)."""

from __future__ import annotations

import asyncio
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiokafka import TopicPartition

from agl_stream.bus.streams import Topics, read_partitions
from agl_stream.dashboard.server import Dashboard
from agl_stream.db.migrate import migrate
from agl_stream.events import WorkerHeartbeat
from agl_stream.queries import ReadModel
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings, child_environment
from tests.support.helpers import eventually, traversable
from tests.support.postgres_faults import DiskUnavailable, KillablePostgres
from tests.support.projection import (
    assert_equals_replay,
    caught_up,
    dump,
    ends,
    publish_slowly,
)
from tests.support.traffic import traffic

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@dataclass(frozen=True)
class FaultSize:
    rollouts: int
    kills: int
    down_seconds: float
    full_seconds: float


SIZES = {
    "ci": FaultSize(rollouts=300, kills=2, down_seconds=10, full_seconds=10),
    "long": FaultSize(rollouts=1500, kills=10, down_seconds=120, full_seconds=120),
}
DISK_MB = 160  # PostgreSQL 18's cluster and the read model take ~45 MB of it


async def start_projector(
    kafka: KafkaSettings, database: DatabaseSettings, log: Path
) -> asyncio.subprocess.Process:
    with log.open("ab") as out:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agl_stream.cli.main", "worker", "projector",
            "--worker-id", "rider", "--batch-size", "200", "--heartbeat", "1",
            env=child_environment(kafka, database), stdout=out, stderr=out,
        )  # fmt: skip


async def stop_projector(projector: asyncio.subprocess.Process) -> None:
    """SIGTERM, and its exit (0 is checked at the end). The replay check compares the read
    model with the topics up to where it stands: a projector still running projects its own
    heartbeats between the two reads, which then differ."""
    projector.send_signal(signal.SIGTERM)
    await asyncio.wait_for(projector.wait(), 60)


async def api(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, object]]:
    async with http.get(f"{url}/api/rollouts", params={"limit": "5"}) as response:
        return response.status, await response.json()


async def waiting_said(kafka: KafkaSettings) -> bool:
    topics = Topics(kafka)
    tps = [
        TopicPartition(topics.name("workers"), p) for p in range(topics.specs["workers"].partitions)
    ]
    beats = [
        e
        for e in await read_partitions(kafka, tps)
        if isinstance(e, WorkerHeartbeat) and e.worker_id == "rider"
    ]
    return any(b.counts.get("database_waiting") == 1 for b in beats)


async def test_postgres_killed_and_down_under_load(
    kafka: KafkaSettings, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    size = SIZES[str(request.config.getoption("--faults-size"))]
    rng = random.Random(37)
    pg = KillablePostgres(traversable(tmp_path / "pg"))
    pg.start()
    database = pg.settings
    log = tmp_path / "projector.log"
    projector = None
    dashboard = Dashboard(database, kafka)
    try:
        await migrate(database)
        projector = await start_projector(kafka, database, log)
        url = await dashboard.start()
        sent = traffic(seed=37, rollouts=size.rollouts)
        # Spread over the kills and the outage: the load goes on through them.
        pause = (size.kills * 4 + size.down_seconds) / (len(sent) / 150)
        publishing = asyncio.create_task(publish_slowly(kafka, sent, pause=pause))

        def projector_alive() -> None:
            assert projector is not None
            if projector.returncode is not None:
                pytest.fail(f"the projector exited ({projector.returncode}):\n{log.read_text()}")

        for _ in range(size.kills):
            await asyncio.sleep(rng.uniform(2.0, 4.0))
            await pg.kill()
            await asyncio.sleep(rng.uniform(0.0, 1.0))
            await pg.restart()
            projector_alive()

        async with aiohttp.ClientSession() as http:
            assert (await api(http, url))[0] == 200
            await pg.kill()
            down_at = time.monotonic()
            status, body = await api(http, url)
            assert status == 503, body
            assert "PostgreSQL" in str(body), body
            # Its heartbeats go on meanwhile, saying that it waits for the database.
            await eventually(lambda: waiting_said(kafka), 30, "a heartbeat saying it waits")
            await asyncio.sleep(max(0.0, size.down_seconds - (time.monotonic() - down_at)))
            projector_alive()
            await pg.restart()
            back_at = time.monotonic()

            async def answers() -> bool:
                return (await api(http, url))[0] == 200

            await eventually(answers, 30, "the dashboard to answer again")
            await publishing
            final = await ends(kafka)
            await eventually(lambda: caught_up(database, final), 180, "the projector to catch up")
            caught_up_in = time.monotonic() - back_at
        projector_alive()
        said = log.read_text()
        assert "PostgreSQL cannot be used now" in said, said
        assert "PostgreSQL answers again after" in said, said
        await stop_projector(projector)  # its heartbeats would move the read model meanwhile
        await assert_equals_replay(kafka, database)
        live = await dump(database)
        assert len([k for k in live if k.startswith("ro-")]) == size.rollouts
        print(
            f"\nPostgreSQL killed {pg.kills - 1} times and down {size.down_seconds:g} s under "
            f"load ({size.rollouts} rollouts): projector exits 0, lost 0, doubled 0 (equal to a "
            f"replay); caught up {caught_up_in:.1f} s after the database came back"
        )
    finally:
        await dashboard.stop()
        if projector is not None and projector.returncode is None:
            projector.send_signal(signal.SIGTERM)
            await asyncio.wait_for(projector.wait(), 60)
        await asyncio.to_thread(pg.stop)
    assert projector.returncode == 0, log.read_text()


async def test_postgres_disk_full_then_freed_under_load(
    kafka: KafkaSettings, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    size = SIZES[str(request.config.getoption("--faults-size"))]
    pg = KillablePostgres(traversable(tmp_path / "pg"), disk_mb=DISK_MB)
    try:
        pg.start()
    except DiskUnavailable as exc:
        pytest.skip(f"no small disk for PostgreSQL here ({exc}): run as root")
    database = pg.settings
    log = tmp_path / "projector.log"
    projector = None
    try:
        await migrate(database)
        projector = await start_projector(kafka, database, log)
        sent = traffic(seed=38, rollouts=size.rollouts)
        third = len(sent) // 3
        await publish_slowly(kafka, sent[:third], chunk=1000, pause=0)
        first = await ends(kafka)
        await eventually(lambda: caught_up(database, first), 120, "the first third projected")
        pg.fill(leave_bytes=256 * 1024)
        await publish_slowly(kafka, sent[third:], chunk=1000, pause=0)

        async def waits_for_space() -> bool:
            return "disk is full" in log.read_text()

        await eventually(waits_for_space, 120, "the projector to find the disk full")
        async with ReadModel.open(database) as model:  # reading needs no space
            assert (await model.rollouts(limit=1)).items
        await asyncio.sleep(size.full_seconds)
        assert projector.returncode is None, log.read_text()
        pg.free()
        freed_at = time.monotonic()
        crashed = not pg.running()  # (a WAL segment it could not add: PANIC, then it stops)
        if crashed:
            await pg.restart()
        final = await ends(kafka)
        await eventually(lambda: caught_up(database, final), 180, "the projector to catch up")
        caught_up_in = time.monotonic() - freed_at
        assert projector.returncode is None, log.read_text()
        await stop_projector(projector)  # its heartbeats would move the read model meanwhile
        await assert_equals_replay(kafka, database)
        live = await dump(database)
        assert len([k for k in live if k.startswith("ro-")]) == size.rollouts
        print(
            f"\nPostgreSQL's disk full {size.full_seconds:g} s under load ({size.rollouts} "
            f"rollouts; the server {'crashed and was started again' if crashed else 'stayed up'}"
            f"): projector exits 0, lost 0, doubled 0 (equal to a replay); caught up "
            f"{caught_up_in:.1f} s after space was freed"
        )
    finally:
        if projector is not None and projector.returncode is None:
            projector.send_signal(signal.SIGTERM)
            await asyncio.wait_for(projector.wait(), 60)
        await asyncio.to_thread(pg.stop)
    assert projector.returncode == 0, log.read_text()
