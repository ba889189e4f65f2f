"""`agl-stream worker projector`: every event topic into the active read model.

Projectors share the partitions through a consumer group (range assignment, so partition p
of tasks, rollouts and spans, which carry the same rollouts, goes to the same projector).
At assignment a projector seeks to the offsets stored in PostgreSQL, not the group's: the
database is the source of truth for how far the projection got.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from aiokafka import (
    AIOKafkaConsumer,
    AIOKafkaProducer,
    ConsumerRebalanceListener,
    TopicPartition,
)
from aiokafka.coordinator.assignors.range import RangePartitionAssignor

from agl_stream.bus.dead_letters import dead_letter
from agl_stream.bus.kafka import consumer, producer
from agl_stream.bus.roles import role
from agl_stream.bus.streams import DLQ_TOPIC, Batch, EventPublisher, EventStream, Topics
from agl_stream.bus.topic_admin import ensure_topics_ready
from agl_stream.db.outage import Outage, riding_out, unavailable
from agl_stream.events import WorkerHeartbeat, WorkerRole, WorkerStatus
from agl_stream.projection.apply import (
    CONVERTERS,
    Applied,
    Behind,
    DeadLetterSink,
    Projection,
    Refused,
    Switched,
)
from agl_stream.projection.store import Partition, active_read_model, connect
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings
from agl_stream.telemetry.metrics import WorkerMetrics

log = logging.getLogger(__name__)

GROUP_COMMIT_SECONDS = 2.0
PROJECTED_TOPICS = ("tasks", "rollouts", "spans", "resources", "workers")


def _host() -> str:
    return socket.gethostname()


def projector_group(topic_prefix: str) -> str:
    """The projectors' consumer group (workers/projector.toml): agl-projector for the default
    prefix."""
    return role("projector").group_id(topic_prefix)


@dataclass
class ProjectorConfig:
    group_id: str | None = None
    worker_id: str = field(default_factory=lambda: f"projector-{_host()}-{os.getpid()}")
    max_batch: int = 5000
    heartbeat_seconds: float = 5.0
    session_timeout_ms: int = 10_000


class Projector:
    def __init__(
        self, kafka: KafkaSettings, database: DatabaseSettings, config: ProjectorConfig
    ) -> None:
        self.kafka = kafka
        self.database = database
        self.config = config
        self.topics = Topics(kafka)
        self.group_id = config.group_id or projector_group(kafka.topic_prefix)
        self.counts: Counter[str] = Counter()
        self._projection: Projection | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._stream: EventStream | None = None
        self._lock = asyncio.Lock()  # one transaction at a time (rebalance vs loop)
        self._group_offsets: dict[TopicPartition, int] = {}
        self._group_committed_at = 0.0
        self._outage = Outage(f"the projector {config.worker_id}")
        self.metrics = WorkerMetrics(
            "projector", lambda: {**self.counts, "lag": self.lag()}, self.partition_lag
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Project until `stop`; PostgreSQL going away (killed, restarted, down for minutes)
        is waited out: the projector reconnects with backoff and starts over from the offsets
        the database holds, so nothing is lost or applied twice."""
        await ensure_topics_ready(self.kafka, PROJECTED_TOPICS)
        # Heartbeats go on while PostgreSQL is away (saying so): the projector is alive.
        async with producer(self.kafka) as prod:
            publisher = EventPublisher(prod, self.topics)
            beats = asyncio.create_task(self._heartbeats(publisher, stop))
            try:
                await riding_out(lambda: self._run(stop), self._outage.what, self._outage)
            finally:
                beats.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beats
                if stop.is_set():
                    await self._heartbeat(publisher, WorkerStatus.STOPPED)

    async def _run(self, stop: asyncio.Event) -> None:
        conn = await connect(self.database.asyncpg_dsn)
        try:
            schema = await active_read_model(conn)
            async with (
                producer(self.kafka) as prod,
                consumer(
                    self.kafka,
                    group_id=self.group_id,
                    session_timeout_ms=self.config.session_timeout_ms,
                    heartbeat_interval_ms=max(self.config.session_timeout_ms // 5, 500),
                    max_poll_interval_ms=60_000,
                    partition_assignment_strategy=(RangePartitionAssignor,),
                    max_partition_fetch_bytes=4 * 1024 * 1024,
                ) as reader,
            ):
                self._consumer = reader
                self._projection = Projection(conn, schema, dead_letters=self._letters_to(prod))
                reader.subscribe(
                    [self.topics.name(t) for t in PROJECTED_TOPICS], listener=_Rebalance(self)
                )
                stream = self._stream = EventStream(
                    reader, prod, self.topics, self.group_id, converters=CONVERTERS
                )
                await self._loop(stream, stop)
                await self._commit_group()
        except Exception as exc:
            if unavailable(exc):
                self.counts["database_outages"] += 1
            raise
        finally:
            self._projection = None
            # A connection PostgreSQL dropped may not answer a polite close.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 5)
            conn.terminate()

    def _letters_to(self, prod: AIOKafkaProducer) -> DeadLetterSink:
        """Dead letters of records the projection refuses (rewards that do not count, records
        the database cannot hold)."""

        async def send(refused: Refused) -> None:
            letter = dead_letter(
                topic=refused.topic, partition=refused.partition, offset=refused.offset,
                timestamp_ms=refused.timestamp_ms, value=refused.value, headers=refused.headers,
                reason=refused.reason, kind=refused.kind, consumer=self.group_id,
            )  # fmt: skip
            dlq = self.topics.name(DLQ_TOPIC)
            await prod.send_and_wait(dlq, letter.value, key=letter.key, headers=letter.headers)
            self.counts["dead_letters"] += 1

        return send

    @property
    def projection(self) -> Projection:
        assert self._projection is not None, "the projector is not running"
        return self._projection

    async def _loop(self, stream: EventStream, stop: asyncio.Event) -> None:
        # One batch is written while the next is fetched and decoded (decoding is most of
        # the CPU); batches still commit one after another, in order.
        writing: asyncio.Task[None] | None = None
        try:
            while not stop.is_set():
                batch = await stream.next_batch(timeout_ms=500, max_records=self.config.max_batch)
                if writing is not None:
                    await writing
                    writing = None
                if batch.next_offsets:
                    writing = asyncio.create_task(self._apply_locked(batch))
            if writing is not None:
                await writing
        finally:
            if writing is not None and not writing.done():
                writing.cancel()

    async def _apply_locked(self, batch: Batch) -> None:
        async with self._lock:
            await self._apply(batch)

    async def _apply(self, batch: Batch) -> None:
        reader = self._consumer
        assert reader is not None
        ends = {(tp.topic, tp.partition): reader.highwater(tp) or 0 for tp in batch.next_offsets}
        began = time.monotonic()
        with self.metrics.tracer.span("projector.batch") as span:
            outcome = await self.projection.apply(batch, ends)
            span.set_attributes({
                "agl.records": len(batch), "agl.projector.outcome": type(outcome).__name__.lower(),
            })  # fmt: skip
            if isinstance(outcome, Applied):
                span.set_attributes({"agl.events": outcome.events, "agl.spans": outcome.spans})
        self._outage.back()  # a transaction went through (a read alone may, with a full disk)
        if isinstance(outcome, Applied):
            self.metrics.observe(
                "batch", time.monotonic() - began, "One batch's transaction in PostgreSQL."
            )
            self.counts["events"] += outcome.events
            self.counts["spans"] += outcome.spans
            self.counts["batches"] += 1
            self.counts["dead_letters"] += batch.dead_lettered
            self._group_offsets.update(batch.next_offsets)
            if time.monotonic() - self._group_committed_at >= GROUP_COMMIT_SECONDS:
                await self._commit_group()
        elif isinstance(outcome, Switched):
            log.warning("the active read model is now %s: following it", outcome.schema)
            self.projection.follow(outcome.schema)
            await self._seek(reader.assignment())
        elif isinstance(outcome, Behind):
            log.warning("the database is behind the consumer at %s: seeking back", outcome.offsets)
            await self._seek(TopicPartition(t, p) for (t, p) in outcome.offsets)

    async def _commit_group(self) -> None:
        """The group's offsets only inform `agl-stream status` (PostgreSQL's are the truth),
        so they are committed now and then, not with every batch."""
        self._group_committed_at = time.monotonic()
        if self._consumer is None or not self._group_offsets:
            return
        offsets, self._group_offsets = self._group_offsets, {}
        assigned = self._consumer.assignment()
        try:
            await self._consumer.commit({tp: o for tp, o in offsets.items() if tp in assigned})
        except Exception as exc:  # noqa: BLE001 - e.g. during a rebalance; the next one will do
            self.counts["group_commits_failed"] += 1
            log.info("the group's offsets were not committed (the next commit will): %r", exc)

    async def _seek(self, partitions: Iterable[TopicPartition]) -> None:
        """Seek to the offsets stored in the read model (the beginning where none is)."""
        reader = self._consumer
        assert reader is not None
        tps = list(partitions)
        stored = await self.projection.store.offsets()
        positions = self.projection.positions
        for tp in tps:
            key: Partition = (tp.topic, tp.partition)
            if key in stored:
                self.stream.seek(tp, stored[key])
                positions[key] = stored[key]
            else:
                await reader.seek_to_beginning(tp)
                self.stream.forget(tp)
                positions[key] = None

    @property
    def stream(self) -> EventStream:
        assert self._stream is not None, "the projector's stream is not open"
        return self._stream

    def lag(self) -> int:
        return sum(self.partition_lag().values())

    def partition_lag(self) -> dict[tuple[str, int], int]:
        """Per assigned partition: records between what the read model holds and the end."""
        reader = self._consumer
        if reader is None or self._projection is None:
            return {}
        lag = {}
        for tp in reader.assignment():
            position = self.projection.positions.get((tp.topic, tp.partition)) or 0
            lag[(tp.topic, tp.partition)] = max(0, (reader.highwater(tp) or 0) - position)
        return lag

    async def _heartbeats(self, publisher: EventPublisher, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._heartbeat(publisher, WorkerStatus.BUSY if self.lag() else WorkerStatus.IDLE)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.heartbeat_seconds)

    async def _heartbeat(self, publisher: EventPublisher, status: WorkerStatus) -> None:
        """Best effort: a heartbeat that cannot go is logged; the next one tries again."""
        waiting = int(self._outage.began is not None)  # PostgreSQL away: it waits for it
        try:
            await publisher.publish(
                "workers",
                WorkerHeartbeat(
                    worker_id=self.config.worker_id, role=WorkerRole.PROJECTOR, status=status,
                    hostname=socket.gethostname(), pid=os.getpid(),
                    counts={**self.counts, "lag": self.lag(), "database_waiting": waiting},
                    interval_seconds=self.config.heartbeat_seconds,
                ),
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - logged; the next heartbeat tries again
            self.counts["heartbeats_failed"] += 1
            log.warning("a heartbeat could not be published: %r", exc)


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, projector: Projector) -> None:
        self.projector = projector

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        # The loop's transaction (if any) ends before the partitions go.
        async with self.projector._lock:
            for tp in revoked:
                self.projector.projection.positions.pop((tp.topic, tp.partition), None)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        async with self.projector._lock:
            await self.projector._seek(assigned)
