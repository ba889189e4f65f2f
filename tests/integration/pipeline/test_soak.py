"""The soak benchmark at a CI size: 1,500 rollouts over a minute on the embedded stack, a
runner restarted every 8 s (SIGTERM or kill -9), the projector and the trainer killed every
30 s, topics keeping 30 s. Nothing is lost or run twice, no worker
dies by itself or refuses to stop, progress never stalls, and retention deletes old
segments meanwhile. (`make soak`: 1M rollouts over an hour; figures in the README.)"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
from aiokafka import TopicPartition

from agl_stream.bus.kafka import consumer
from agl_stream.bus.topic_admin import apply_topics
from agl_stream.db.migrate import migrate
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings, load
from benchmarks.soak import parser, report, soak, soak_topics
from tests.support.backends import Backend
from tests.support.helpers import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@contextlib.asynccontextmanager
async def soak_database(backend: Backend, name: str) -> AsyncIterator[DatabaseSettings]:
    base = load(DatabaseSettings, database_url=backend.database_url)
    settings = base.with_database(name)
    await migrate(settings)
    try:
        yield settings
    finally:
        conn = await asyncpg.connect(base.with_database("postgres").asyncpg_dsn)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()


async def test_a_short_soak_loses_nothing_and_never_stalls(
    embedded_backend: Backend, unique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGL_STREAM_TOPICS_DIR", str(soak_topics(tmp_path, 0.5)))
    kafka = load(
        KafkaSettings, bootstrap_servers=embedded_backend.bootstrap_servers,
        topic_prefix=f"soak{unique}.",
    )  # fmt: skip
    await apply_topics(kafka)
    args = parser().parse_args([
        "--rollouts", "1500", "--minutes", "1", "--runners", "3", "--restart-every", "8",
        "--others-every", "30", "--sample-every", "5", "--retention-minutes", "0.5",
        "--drain-seconds", "240",
    ])  # fmt: skip
    stack = embedded_backend.stack.running() if embedded_backend.stack else None
    async with soak_database(embedded_backend, f"soak_{unique}") as database:
        result = await soak(kafka, database, stack.broker_pids if stack else [], tmp_path, args)
    report(result)
    assert result["rollouts"] == 1500
    assert result["lost"] == 0
    assert result["run_twice"] == 0
    assert result["unclean_exits"] == []
    assert result["restarts"] >= 8
    assert result["longest_stall_s"] < 60

    async def old_segments_deleted() -> bool:
        tp = TopicPartition(kafka.topic("tasks"), 0)
        async with consumer(kafka) as reader:
            return (await reader.beginning_offsets([tp]))[tp] > 0

    await eventually(old_segments_deleted, 180, "retention to delete old segments of agl.tasks")
