"""Driving projectors in tests, and the whole read model as the query API sees it."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiokafka import TopicPartition

from agl_stream.bus.kafka import end_offsets, producer
from agl_stream.bus.streams import EventPublisher, Topics
from agl_stream.projection.projector import PROJECTED_TOPICS, Projector, ProjectorConfig
from agl_stream.projection.replay import ReplayLimits, replay
from agl_stream.queries import ReadModel
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings, child_environment
from tests.support.traffic import Traffic


@asynccontextmanager
async def projector_in_process(
    kafka: KafkaSettings, database: DatabaseSettings, **config: Any
) -> AsyncIterator[Projector]:
    settings = {"session_timeout_ms": 6000, "heartbeat_seconds": 1.0}
    projector = Projector(kafka, database, ProjectorConfig(**{**settings, **config}))
    stop = asyncio.Event()
    task = asyncio.create_task(projector.run(stop))
    try:
        yield projector
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


async def projector_process(
    kafka: KafkaSettings, database: DatabaseSettings, name: str, batch_size: int = 500
) -> asyncio.subprocess.Process:
    env = child_environment(kafka, database)
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agl_stream.cli.main", "worker", "projector",
        "--worker-id", name, "--batch-size", str(batch_size), "--session-timeout-ms", "6000",
        "--heartbeat", "1",
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def dump(database: DatabaseSettings, read_model: str | None = None) -> dict[str, Any]:
    """Every rollout with its attempts and spans, every resources version, every worker
    (less its health, which depends on the clock), through the query API."""
    out: dict[str, Any] = {}
    async with ReadModel.open(database, read_model) as rm:
        cursor = None
        while True:
            page = await rm.rollouts(sort="id", limit=1000, cursor=cursor)
            for rollout in page.items:
                out[rollout.rollout_id] = {
                    "rollout": rollout.model_dump(),
                    "attempts": [a.model_dump() for a in await rm.attempts(rollout.rollout_id)],
                    "spans": [s.model_dump() for s in await rm.spans(rollout.rollout_id)],
                }
            cursor = page.next_cursor
            if cursor is None:
                break
        out["resources"] = [r.model_dump() for r in await rm.resources_history(limit=1000)]
        out["workers"] = [w.model_dump(exclude={"health"}) for w in await rm.workers()]
    return out


async def caught_up(database: DatabaseSettings, kafka_ends: dict[tuple[str, int], int]) -> bool:
    async with ReadModel.open(database) as rm:
        stored = {(p.topic, p.partition): p.next_offset for p in await rm.lag()}
    return all(stored.get(p, 0) >= end for p, end in kafka_ends.items() if end > 0)


async def ends(kafka: KafkaSettings) -> dict[tuple[str, int], int]:
    topics = Topics(kafka)
    tps = [
        TopicPartition(topics.name(t), p)
        for t in PROJECTED_TOPICS
        for p in range(topics.specs[t].partitions)
    ]
    return {(tp.topic, tp.partition): o for tp, o in (await end_offsets(kafka, tps)).items()}


async def replay_differences(
    kafka: KafkaSettings, database: DatabaseSettings, name: str = "rebuilt"
) -> tuple[list[str], dict[str, Any]]:
    """Replay the records the live projection has seen (the projectors' own last heartbeats
    come after it stopped) into a new read model; the keys whose answers differ, and the
    rebuilt model's contents."""
    live = await dump(database)
    async with ReadModel.open(database) as rm:
        seen = {(p.topic, p.partition): p.next_offset for p in await rm.lag()}
    limits = ReplayLimits(until_offsets=seen)
    await replay(kafka, database, name=name, limits=limits, switch=False)
    again = await dump(database, name)
    differ = sorted(k for k in live.keys() | again.keys() if live.get(k) != again.get(k))
    return differ, again


async def assert_equals_replay(kafka: KafkaSettings, database: DatabaseSettings) -> None:
    """The replay gives the same answers to every query."""
    differ, again = await replay_differences(kafka, database)
    assert len(again) > 2 and differ == [], differ[:5]


async def publish_slowly(
    kafka: KafkaSettings, sent: Traffic, chunk: int = 150, pause: float = 0.05
) -> None:
    async with producer(kafka, linger_ms=5) as prod:
        publisher = EventPublisher(prod, Topics(kafka))
        for start in range(0, len(sent), chunk):
            futures = [await publisher.send(t, e) for t, e in sent[start : start + chunk]]
            await asyncio.gather(*futures)
            await asyncio.sleep(pause)
