"""The store facade's engine: one fenced writer of the facade's records, on its own event loop.

How a call works: under one lock, it reads the records it needs from the read model, decides
(records.py), writes the new revisions (and spans) to the topics in one Kafka transaction,
and waits until the projector has applied them, so the next call reads its effect
(read-your-writes). Decisions therefore always see every earlier decision.

Why one fenced writer: Agent Lightning's store promises that each call is atomic, dequeue is
FIFO across every queued rollout, and a rollout is handed out once. The transactional id is
the same for every store on a topic prefix (`<prefix>agl-store`), so a second store process
fences the first: Kafka aborts the first one's open transaction and refuses its later ones,
so a frozen or restarted old process can never hand out a rollout the new one hands out too.
(Claiming through the runners' consumer group would split the queue by partition: FIFO and
start_rollout/update_rollout on any rollout need a writer that sees them all.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import asyncpg
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import ProducerFenced
from aiokafka.structs import RecordMetadata

from agl_stream.bus.kafka import end_offsets, started
from agl_stream.bus.streams import EventPublisher, Topics
from agl_stream.bus.topic_admin import ensure_topics_ready
from agl_stream.compat.agl.reads import Reads
from agl_stream.compat.agl.records import (
    AnyRecord,
    AttemptRecord,
    RolloutRecord,
    WorkerRecord,
)
from agl_stream.events import AglRecordKind, AglRecordRevised, SpanRecorded
from agl_stream.projection.projector import Projector, ProjectorConfig
from agl_stream.projection.store import NOTIFY_CHANNEL, active_read_model, init_connection
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings
from agl_stream.runtime.supervision import restarting

log = logging.getLogger(__name__)

# Every record goes on the rollouts topic (workers and resources under keys of their own), so
# the event has one home; spans go on the spans topic.
STORE_TOPICS = ("rollouts", "spans")
CATCH_UP_SECONDS = 15.0


class StoreFenced(RuntimeError):
    """Another store process took over these topics; this one writes nothing more."""


def transactional_id(kafka: KafkaSettings) -> str:
    return f"{kafka.topic_prefix}agl-store"


class ProjectionWatch:
    """Wakes waiters when the projector commits (its NOTIFY), through one LISTEN connection."""

    def __init__(self, reads: Reads) -> None:
        self.reads = reads
        self._woken = asyncio.Event()
        self._conn: asyncpg.Connection | None = None

    async def start(self, dsn: str) -> None:
        self._conn = await asyncpg.connect(dsn)
        await self._conn.add_listener(NOTIFY_CHANNEL, self._notified)

    def _notified(self, *_: object) -> None:
        woken, self._woken = self._woken, asyncio.Event()
        woken.set()

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()

    async def changed(self, within: float) -> None:
        """Return at the next projection commit, or after `within` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._woken.wait(), within)

    async def offsets(self, offsets: Mapping[tuple[str, int], int], within: float) -> bool:
        """Wait until the projection holds each (topic, partition) record at or past the
        offset; False when `within` seconds pass first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while True:
            woken = self._woken  # taken before reading: no commit goes unnoticed
            rows = await self.reads.fetch(
                f"SELECT topic, partition, next_offset FROM {self.reads.table('projector_offsets')}"
            )
            stored = {(r["topic"], r["partition"]): r["next_offset"] for r in rows}
            if all(stored.get(p, 0) > offset for p, offset in offsets.items()):
                return True
            left = deadline - loop.time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), min(left, 1.0))


class Core:
    """The writer and the reads, living on the store's event loop."""

    def __init__(
        self, kafka: KafkaSettings, database: DatabaseSettings, run_projector: bool
    ) -> None:
        self.kafka = kafka
        self.database = database
        self.run_projector = run_projector
        self.topics = Topics(kafka)
        self.lock = asyncio.Lock()
        self._producer: AIOKafkaProducer | None = None
        self._publisher: EventPublisher | None = None
        self._pool: asyncpg.Pool | None = None
        self._reads: Reads | None = None
        self._watch: ProjectionWatch | None = None
        self._stop = asyncio.Event()
        self._projector: asyncio.Task[None] | None = None
        self.fenced: StoreFenced | None = None

    @property
    def reads(self) -> Reads:
        assert self._reads is not None, "the store is not started"
        return self._reads

    @property
    def watch(self) -> ProjectionWatch:
        assert self._watch is not None, "the store is not started"
        return self._watch

    async def start(self) -> None:
        await ensure_topics_ready(self.kafka, STORE_TOPICS)
        dsn = self.database.asyncpg_dsn
        self._pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4, init=init_connection)
        async with self._pool.acquire() as conn:
            schema = await active_read_model(conn)
            has_table = await conn.fetchval(
                "SELECT to_regclass($1) IS NOT NULL", f'"{schema}".agl_records'
            )
        if not has_table:
            raise RuntimeError(
                f"the read model {schema} has no agl_records table: run `agl-stream db upgrade`"
            )
        self._reads = Reads(self._pool, schema)
        self._watch = ProjectionWatch(self._reads)
        await self._watch.start(dsn)
        if self.run_projector:
            projector = Projector(self.kafka, self.database, ProjectorConfig())
            self._projector = asyncio.create_task(
                restarting(lambda: projector.run(self._stop), "the store's projector"),
                name="agl-store-projector",
            )
        # What earlier stores committed, read before this one fences them: the last stable
        # offsets (an open transaction of a killed store holds them at its first record, so
        # what its abort leaves past them is not waited for).
        ends = await self._stable_ends()
        self._producer = AIOKafkaProducer(
            acks="all",
            enable_idempotence=True,
            transactional_id=transactional_id(self.kafka),
            linger_ms=0,
            **self.kafka.client_options(),
        )
        await started(self._producer)  # fences any earlier store on these topics
        self._publisher = EventPublisher(self._producer, self.topics)
        await self._catch_up(ends)

    async def _stable_ends(self) -> dict[TopicPartition, int]:
        parts = []
        for short in STORE_TOPICS:
            name = self.topics.name(short)
            parts += [TopicPartition(name, p) for p in range(self.topics.specs[short].partitions)]
        return await end_offsets(self.kafka, parts)  # read_committed: the last stable offsets

    async def _catch_up(self, ends: dict[TopicPartition, int]) -> None:
        """Before the first decision, the projection holds what earlier stores committed."""
        wanted = {(tp.topic, tp.partition): end - 1 for tp, end in ends.items() if end > 0}
        if wanted and not await self.watch.offsets(wanted, CATCH_UP_SECONDS):
            log.warning(
                "the read model had not reached the topics' ends %s after %.0f s (is a "
                "projector running?); going on",
                wanted,
                CATCH_UP_SECONDS,
            )

    async def close(self) -> None:
        self._stop.set()
        if self._projector is not None:
            self._projector.cancel()
            await asyncio.gather(self._projector, return_exceptions=True)
        if self._producer is not None:
            await self._producer.stop()
        if self._watch is not None:
            await self._watch.close()
        if self._pool is not None:
            await self._pool.close()

    # ---- writing -----------------------------------------------------------------------

    async def write(
        self, records: Sequence[AnyRecord], spans: Sequence[SpanRecorded] = ()
    ) -> list[AnyRecord]:
        """Write the records' next revisions and the spans in one transaction, then wait until
        the projection holds them. Returns the records with their new revisions."""
        if self.fenced is not None:
            raise self.fenced
        assert self._producer is not None
        assert self._publisher is not None
        now = datetime.now(UTC)
        written = [_next_revision(r, now.timestamp()) for r in records]
        sends: list[asyncio.Future[RecordMetadata]] = []
        try:
            async with self._producer.transaction():
                for record in written:
                    topic, event = _event(record, now)
                    sends.append(await self._publisher.send(topic, event))
                for span in spans:
                    sends.append(await self._publisher.send("spans", span))
            metas = [await f for f in sends]
        except ProducerFenced as exc:
            _forget(sends)
            self.fenced = StoreFenced(
                "another agl-stream store took over the topics with prefix "
                f"{self.kafka.topic_prefix!r}: this one writes nothing more ({exc})"
            )
            raise self.fenced from exc
        except BaseException:
            _forget(sends)
            raise
        await self.wait_for(metas)
        return written

    async def wait_for(self, metas: Iterable[RecordMetadata], within: float = 30.0) -> None:
        wanted: dict[tuple[str, int], int] = {}
        for m in metas:
            key = (m.topic, m.partition)
            wanted[key] = max(wanted.get(key, -1), m.offset)
        if wanted and not await self.watch.offsets(wanted, within):
            raise TimeoutError(
                f"the read model did not apply the store's write {wanted} within {within:g} s: "
                "is a projector running (`agl-stream worker projector`)?"
            )


def _forget(sends: Iterable[asyncio.Future[RecordMetadata]]) -> None:
    """The sends of an aborted transaction fail with it: their errors are the caller's."""
    for f in sends:
        f.add_done_callback(lambda done: done.cancelled() or done.exception())


def _check_numbers(value: Any) -> None:
    """ValueError (a 400 over HTTP) for an integer beyond 64 bits: Python's JSON takes one, the
    read model's (orjson, then jsonb) does not, so the projector would dead-letter the record
    the store had said it kept. (Floats that are not finite are null in a model's JSON.)"""
    if isinstance(value, dict):
        for item in value.values():
            _check_numbers(item)
    elif isinstance(value, list | tuple):
        for item in value:
            _check_numbers(item)
    elif isinstance(value, int) and not isinstance(value, bool) and not _INT64 <= value < -_INT64:
        raise ValueError(f"the number {value} does not fit 64 bits, the most the store keeps")


_INT64 = -(2**63)


def _next_revision(record: AnyRecord, now: float) -> AnyRecord:
    created = record.created_at if record.revision > 0 else now
    return replace(record, revision=record.revision + 1, created_at=created)


def _event(record: AnyRecord, now: datetime) -> tuple[str, AglRecordRevised]:
    created = datetime.fromtimestamp(record.created_at, UTC)
    content = record.body()
    _check_numbers(content)
    body = json.dumps(content, separators=(",", ":"))
    common: dict[str, Any] = {
        "revision": record.revision,
        "created_at": created,
        "body_json": body,
        "occurred_at": now,
    }
    if isinstance(record, RolloutRecord):
        rid = record.rollout.rollout_id
        return "rollouts", AglRecordRevised(
            kind=AglRecordKind.ROLLOUT, partition_key=rid, record_id=rid, rollout_id=rid, **common
        )
    if isinstance(record, AttemptRecord):
        a = record.attempt
        return "rollouts", AglRecordRevised(
            kind=AglRecordKind.ATTEMPT,
            partition_key=a.rollout_id,
            record_id=a.attempt_id,
            rollout_id=a.rollout_id,
            **common,
        )
    if isinstance(record, WorkerRecord):
        wid = record.worker.worker_id
        return "rollouts", AglRecordRevised(
            kind=AglRecordKind.WORKER, partition_key=f"agl-worker:{wid}", record_id=wid, **common
        )
    res = record.update.resources_id
    return "rollouts", AglRecordRevised(
        kind=AglRecordKind.RESOURCES,
        partition_key=f"agl-resources:{res}",
        record_id=res,
        **common,
    )
