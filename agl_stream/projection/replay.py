"""`agl-stream replay`: rebuild the read model from the topics into a fresh schema.

The live read model keeps answering queries while the new one fills; when the new one has
caught up with the topics it becomes the active one in one transaction, and live projectors
follow it from its offsets. With a stop time or stop offsets the replay shows the state as
it was then, and stays inactive (query it with --read-model).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer, TopicPartition

from agl_stream.bus.kafka import admin_client, consumer, end_offsets
from agl_stream.bus.streams import Batch, EventStream, Topics
from agl_stream.db.migrate import create_read_model
from agl_stream.projection.apply import CONVERTERS, Applied, Projection
from agl_stream.projection.projector import PROJECTED_TOPICS
from agl_stream.projection.store import Partition, connect
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings

Progress = Callable[[int, int], None]  # (records done, records to do)


@dataclass(frozen=True)
class ReplayLimits:
    """Where to stop: records after `until_time` (broker timestamp), and per partition the
    offset to stop before. Empty: read to the end."""

    until_time: datetime | None = None
    until_offsets: Mapping[Partition, int] = field(default_factory=dict)

    @property
    def historical(self) -> bool:
        return self.until_time is not None or bool(self.until_offsets)


@dataclass(frozen=True)
class ReplayResult:
    name: str
    events: int
    dead_letters: int
    switched: bool


async def list_read_models(database: DatabaseSettings) -> list[dict[str, Any]]:
    """Every read model: name, active, state, created_at (ISO), description."""
    conn = await connect(database.asyncpg_dsn)
    try:
        rows = await conn.fetch(
            "SELECT name, active, state, created_at, description FROM public.read_models "
            "ORDER BY created_at, name"
        )
    finally:
        await conn.close()
    return [{**dict(r), "created_at": r["created_at"].isoformat()} for r in rows]


async def next_read_model_name(database: DatabaseSettings) -> str:
    names = [m["name"] for m in await list_read_models(database)]
    numbers = [int(m.group(1)) for n in names if (m := re.fullmatch(r"read_model_(\d+)", n))]
    return f"read_model_{max(numbers, default=0) + 1}"


async def replay(
    kafka: KafkaSettings,
    database: DatabaseSettings,
    name: str | None = None,
    limits: ReplayLimits | None = None,
    switch: bool | None = None,
    progress: Progress | None = None,
) -> ReplayResult:
    """Build read model `name` (default: the next read_model_N) from the topics; switch to
    it when caught up (default: unless `limits` look at the past)."""
    limits = limits or ReplayLimits()
    switch = (not limits.historical) if switch is None else switch
    name = name or await next_read_model_name(database)
    await create_read_model(database, name, _describe(limits))
    conn = await connect(database.asyncpg_dsn)
    topics = Topics(kafka)
    try:
        projection = Projection(conn, name, follow_active=False)
        async with consumer(kafka) as reader:
            tps = await projected_partitions(kafka, topics)
            reader.assign(tps)
            for tp in tps:
                reader.seek(tp, 0)
                projection.positions[(tp.topic, tp.partition)] = None
            stream = EventStream(reader, None, topics, f"replay-{name}", converters=CONVERTERS)
            rounds = _Rounds(kafka, reader, stream, projection, limits, progress)
            await rounds.catch_up(tps)
            if switch and not limits.historical:
                await rounds.catch_up(tps)  # what arrived during the first round
            if switch:
                await _activate(conn, name)
            return ReplayResult(name, rounds.events, rounds.dead_letters, switch)
    finally:
        await conn.close()


@dataclass
class _Rounds:
    kafka: KafkaSettings
    reader: AIOKafkaConsumer
    stream: EventStream
    projection: Projection
    limits: ReplayLimits
    progress: Progress | None
    events: int = 0
    dead_letters: int = 0

    async def catch_up(self, tps: list[TopicPartition]) -> None:
        """Read every partition up to its end as of now (or its limit)."""
        ends = await end_offsets(self.kafka, tps)
        targets = {
            tp: min(ends[tp], self.limits.until_offsets.get((tp.topic, tp.partition), ends[tp]))
            for tp in tps
        }
        positions = self.projection.positions
        starts = {tp: positions.get((tp.topic, tp.partition)) or 0 for tp in tps}
        total = sum(max(0, targets[tp] - starts[tp]) for tp in tps)
        open_ = {tp for tp in tps if starts[tp] < targets[tp]}
        self.reader.resume(*tps)
        self.reader.pause(*(set(tps) - open_))
        while open_:
            batch = await self.stream.next_batch(timeout_ms=500, max_records=5000)
            finished = self._cut(batch, targets)
            ends_seen = {(tp.topic, tp.partition): targets[tp] for tp in batch.next_offsets}
            outcome = await self.projection.apply(batch, ends_seen)
            if isinstance(outcome, Applied):
                self.events += outcome.events
            self.dead_letters += batch.dead_lettered
            for tp in list(open_):
                position = positions.get((tp.topic, tp.partition)) or 0
                if position < targets[tp]:  # only markers left (no record): the reader is past
                    position = max(position, await self.stream.position(tp))
                if position >= targets[tp] or tp in finished:
                    open_.discard(tp)
                    self.reader.pause(tp)
            if self.progress is not None:
                done = sum(
                    min(targets[tp], positions.get((tp.topic, tp.partition)) or 0) - starts[tp]
                    for tp in tps
                )
                self.progress(done if open_ else total, total)

    def _cut(self, batch: Batch, targets: Mapping[TopicPartition, int]) -> set[TopicPartition]:
        """Drop what lies past the limits; the partitions that reached one."""
        finished = set()
        until_ms = (
            None if self.limits.until_time is None else self.limits.until_time.timestamp() * 1000
        )
        for tp in list(batch.next_offsets):
            stop = targets[tp]
            if until_ms is not None:
                for item in (*batch.events.get(tp, ()), *batch.converted.get(tp, ())):
                    if (item.timestamp_ms or 0) > until_ms:
                        stop = min(stop, item.offset)
            if batch.next_offsets[tp] >= stop:
                finished.add(tp)
                batch.next_offsets[tp] = stop
                batch.events[tp] = [e for e in batch.events.get(tp, ()) if e.offset < stop]
                batch.converted[tp] = [c for c in batch.converted.get(tp, ()) if c.offset < stop]
        return finished


async def projected_partitions(kafka: KafkaSettings, topics: Topics) -> list[TopicPartition]:
    """Every partition of the topics the projector reads."""
    names = [topics.name(short) for short in PROJECTED_TOPICS]
    async with admin_client(kafka) as admin:
        described = {t["topic"]: t for t in await admin.describe_topics(names)}
    out: list[TopicPartition] = []
    for name in names:
        partitions = described.get(name, {}).get("partitions", [])
        out.extend(TopicPartition(name, n) for n in sorted(p["partition"] for p in partitions))
    return out


async def _activate(conn: asyncpg.Connection, name: str) -> None:
    async with conn.transaction():
        # Waits for live projectors' transactions (they hold the active row FOR SHARE).
        await conn.execute("SELECT name FROM public.read_models FOR UPDATE")
        await conn.execute(
            "UPDATE public.read_models SET active = false, state = 'retired' WHERE active"
        )
        await conn.execute(
            "UPDATE public.read_models SET active = true, state = 'active', activated_at = now()"
            " WHERE name = $1",
            name,
        )


def _describe(limits: ReplayLimits) -> str:
    parts = ["replay"]
    if limits.until_time is not None:
        parts.append(f"until {limits.until_time.isoformat()}")
    if limits.until_offsets:
        parts.append(
            "until offsets "
            + ", ".join(f"{t}[{p}]={o}" for (t, p), o in sorted(limits.until_offsets.items()))
        )
    return " ".join(parts)
