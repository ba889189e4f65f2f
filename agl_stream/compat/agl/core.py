"""The store facade's engine: one fenced writer of the facade's records, on its own event loop.

How a call works: under one lock, it decides (records.py) on the store's live state in memory
(live.py: the fold of its own decisions over the read model as it stood at start), applies its
changes to that state, and stages their events; then, without the lock, it waits for the Kafka
transaction that commits them (commit.py: calls that arrive while one transaction is in
flight share the next). A call returns when its events are durable and acknowledged, and the
next call already sees them; it does not wait for the projector. Reads of history (spans,
listings) go to the PostgreSQL read model, waiting for the projection only for the writes they
need (`projected`).

Why one fenced writer: Agent Lightning's store promises that each call is atomic, dequeue is
FIFO across every queued rollout, and a rollout is handed out once. The transactional id is
the same for every store on a topic prefix (`<prefix>agl-store`), so a second store process
fences the first: Kafka aborts the first one's open transaction and refuses its later ones,
so a frozen or restarted old process can never hand out a rollout the new one hands out too.
Being the one writer is also what makes the memory exact: nobody else changes its records.
(Claiming through the runners' consumer group would split the queue by partition: FIFO and
start_rollout/update_rollout on any rollout need a writer that sees them all.)

At start the store fences earlier ones, waits until the read model holds what they committed
(the topics' last stable offsets), and loads the queue, the running rollouts with their
attempts, and the latest resources. A transaction that fails (a broker lost, say) fails its
calls; the next call rebuilds the state the same way before it decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import asyncpg
from agentlightning.types import Attempt, ResourcesUpdate, Worker
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import MessageSizeTooLargeError, ProducerFenced
from aiokafka.structs import RecordMetadata

from agl_stream.bus.kafka import (
    end_offsets,
    last_committed,
    quick_transaction_retries,
    reachable,
    started,
)
from agl_stream.bus.streams import EventPublisher, Topics
from agl_stream.bus.topic_admin import ensure_topics_ready
from agl_stream.compat.agl.commit import GroupCommit
from agl_stream.compat.agl.live import (
    KEPT,
    Commit,
    Kept,
    Live,
    Position,
    RolloutState,
    SpanKeys,
    committed,
    projected_past,
)
from agl_stream.compat.agl.projector_process import ProjectorProcess
from agl_stream.compat.agl.reads import Reads, Stored
from agl_stream.compat.agl.records import (
    AnyRecord,
    AttemptRecord,
    ResourcesRecord,
    RolloutRecord,
    WorkerRecord,
)
from agl_stream.events import AglRecordKind, AglRecordRevised, SpanRecorded
from agl_stream.projection.notices import hold_listen
from agl_stream.projection.store import active_read_model, init_connection
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings
from agl_stream.runtime.supervision import restarting

log = logging.getLogger(__name__)

STORE_TOPICS = ("rollouts", "spans")
CATCH_UP_SECONDS = 15.0
PROJECTION_WAIT_SECONDS = 30.0
TRANSACTION_RETRY_MS = 5
# aiokafka's default max_request_size, which the store's producer keeps.
MAX_RECORD_BYTES = 1_048_576


class StoreFenced(RuntimeError):
    """Another store process took over these topics; this one writes nothing more."""


def transactional_id(kafka: KafkaSettings) -> str:
    return f"{kafka.topic_prefix}agl-store"


class ProjectionWatch:
    """Wakes waiters when the projector commits (its NOTIFY), through one LISTEN connection,
    and knows how far the projection got (the next offsets it will apply)."""

    def __init__(self, reads: Reads) -> None:
        self.reads = reads
        self.projected: dict[Position, int] = {}
        self._woken = asyncio.Event()
        self._holding: asyncio.Task[None] | None = None

    async def start(self, dsn: str) -> None:
        # Until it listens, waiters wake by their timeouts (they poll the offsets then).
        self._holding = asyncio.create_task(
            restarting(
                lambda: hold_listen(dsn, self._notified, "the store's LISTEN"),
                "the store's LISTEN connection", cap=5.0,
            ),
            name="listen",
        )  # fmt: skip

    def _notified(self) -> None:
        woken, self._woken = self._woken, asyncio.Event()
        woken.set()

    async def close(self) -> None:
        if self._holding is not None:
            self._holding.cancel()
            await asyncio.gather(self._holding, return_exceptions=True)

    async def changed(self, within: float) -> None:
        """Return at the next projection commit, or after `within` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._woken.wait(), within)

    async def refresh(self) -> dict[Position, int]:
        rows = await self.reads.fetch(
            f"SELECT topic, partition, next_offset FROM {self.reads.table('projector_offsets')}"
        )
        self.projected = {(r["topic"], r["partition"]): r["next_offset"] for r in rows}
        return self.projected

    async def offsets(self, offsets: Mapping[Position, int], within: float) -> bool:
        """Wait until the projection holds each (topic, partition) record at or past the
        offset; False when `within` seconds pass first."""
        if projected_past(offsets, self.projected):
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while True:
            woken = self._woken  # taken before reading: no commit goes unnoticed
            if projected_past(offsets, await self.refresh()):
                return True
            left = deadline - loop.time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), min(left, 1.0))


Holder = RolloutState | Kept


class Core:
    """The writer, the live state and the reads, living on the store's event loop."""

    def __init__(
        self, kafka: KafkaSettings, database: DatabaseSettings, run_projector: bool
    ) -> None:
        self.kafka = kafka
        self.database = database
        self.run_projector = run_projector
        self.topics = Topics(kafka)
        self.lock = asyncio.Lock()
        self.kept = KEPT
        self.live = Live(self.kept)
        self.finished = asyncio.Event()  # set (and replaced) when a rollout finishes
        self.written: dict[Position, int] = {}  # the highest offset committed, per place
        self._producer: AIOKafkaProducer | None = None
        self._publisher: EventPublisher | None = None
        self.max_record_bytes = MAX_RECORD_BYTES
        self._commits: GroupCommit | None = None
        self._pool: asyncpg.Pool | None = None
        self._reads: Reads | None = None
        self._watch: ProjectionWatch | None = None
        self._projector: ProjectorProcess | None = None
        self._evicting: asyncio.Task[None] | None = None
        self._seen: list[Commit] = []  # the commits the current call depends on
        self.fenced: StoreFenced | None = None

    @property
    def reads(self) -> Reads:
        assert self._reads is not None, "the store is not started"
        return self._reads

    @property
    def watch(self) -> ProjectionWatch:
        assert self._watch is not None, "the store is not started"
        return self._watch

    @property
    def publisher(self) -> EventPublisher:
        assert self._publisher is not None, "the store is not started"
        return self._publisher

    @property
    def commits(self) -> GroupCommit:
        assert self._commits is not None, "the store is not started"
        return self._commits

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
            self._projector = ProjectorProcess(self.kafka, self.database)
        await self._take_over()

    async def _take_over(self) -> None:
        """Fence earlier writers, wait for the read model to hold what they committed, and
        load the live state from it."""
        # What earlier stores committed, read before this one fences them: the last stable
        # offsets (an open transaction of a killed store holds them at its first record, so
        # what its abort leaves past them is not waited for).
        ends = await self._stable_ends()
        quick_transaction_retries()  # the store commits back to back
        self._producer = AIOKafkaProducer(
            acks="all",
            enable_idempotence=True,
            transactional_id=transactional_id(self.kafka),
            linger_ms=0,
            # (and its other partitions' retries: aiokafka's default is 100 ms)
            retry_backoff_ms=TRANSACTION_RETRY_MS,
            **(await reachable(self.kafka)).client_options(),
        )
        await started(self._producer)  # fences any earlier store on these topics
        # A transaction the fenced store had asked to commit may have ended since: what it
        # added counts too.
        late = await last_committed(self.kafka, ends, await self._stable_ends())
        self._publisher = EventPublisher(self._producer, self.topics)
        self._commits = GroupCommit(self._producer, self._publisher, self._fence)
        await self._catch_up({**ends, **{tp: offset + 1 for tp, offset in late.items()}})
        self.live = await self._load()

    def _fence(self, exc: ProducerFenced) -> StoreFenced:
        self.fenced = StoreFenced(
            "another agl-stream store took over the topics with prefix "
            f"{self.kafka.topic_prefix!r}: this one writes nothing more ({exc})"
        )
        return self.fenced

    async def _stable_ends(self) -> dict[TopicPartition, int]:
        parts = []
        for short in STORE_TOPICS:
            name = self.topics.name(short)
            parts += [TopicPartition(name, p) for p in range(self.topics.specs[short].partitions)]
        return await end_offsets(self.kafka, parts)  # read_committed: the last stable offsets

    async def _catch_up(self, ends: dict[TopicPartition, int]) -> None:
        """Before the first decision, the projection holds what earlier stores committed. The
        store waits for it however long it takes (saying so every CATCH_UP_SECONDS): its
        memory is built from the read model, and a stale one would hand a rollout out twice.
        (A killed store's projector holds its partitions until its session times out.)"""
        wanted = {(tp.topic, tp.partition): end - 1 for tp, end in ends.items() if end > 0}
        waited = 0.0
        while wanted and not await self.watch.offsets(wanted, CATCH_UP_SECONDS):
            waited += CATCH_UP_SECONDS
            log.warning(
                "the store waits for the read model to reach the topics' ends %s (%.0f s so "
                "far): is a projector running (`agl-stream worker projector`)?",
                wanted,
                waited,
            )

    async def _load(self) -> Live:
        """The live state from the read model: the queue and the running rollouts with their
        attempts, and the latest resources."""
        live = Live(self.kept)
        for state in (await self.load_rollouts(await self.reads.live_rollout_ids())).values():
            live.hold(state)
        latest = await self.reads.latest_resources()
        if latest is not None:
            live.put_resources(resources_record(latest), latest=True)
        log.info(
            "the store holds %d queued and %d running rollouts",
            live.queue_length(),
            len(live.running),
        )
        return live

    async def close(self) -> None:
        if self._evicting is not None:
            self._evicting.cancel()
            await asyncio.gather(self._evicting, return_exceptions=True)
        if self._projector is not None:
            await self._projector.stop()
        if self._commits is not None:
            await self._commits.close()
        if self._producer is not None:
            await self._producer.stop()
        if self._watch is not None:
            await self._watch.close()
        if self._pool is not None:
            await self._pool.close()

    # ---- before each decision -------------------------------------------------------------

    async def ready(self) -> None:
        """Under the lock, before a decision: after a failed transaction, rebuild the state
        (the failed calls' changes are in memory, not on the topics)."""
        if self.fenced is not None:
            raise self.fenced
        failure = self.commits.failure
        if failure is None:
            return
        log.warning("rebuilding the store's state after a failed transaction (%r)", failure)
        with contextlib.suppress(Exception):
            await self.commits.close()
        if self._producer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._producer.stop(), CATCH_UP_SECONDS)
        await self._take_over()

    # ---- loading what memory does not hold -----------------------------------------------

    async def load_rollouts(self, rollout_ids: Sequence[str]) -> dict[str, RolloutState]:
        """Rollouts and their attempts from the read model (not kept: see `rollouts`)."""
        found: dict[str, RolloutState] = {}
        if not rollout_ids:
            return found
        rows = await self.reads.rollouts_with_attempts(rollout_ids)
        for s in rows:
            if s.kind == "rollout":
                found[s.rollout_id] = RolloutState(rollout_record(s))
        for s in rows:
            if s.kind == "attempt" and s.rollout_id in found:
                found[s.rollout_id].attempts[s.record_id] = attempt_record(s)
        return found

    async def rollouts(self, rollout_ids: Sequence[str]) -> dict[str, RolloutState]:
        """The rollouts among these that exist, from memory or loaded (and then kept)."""
        out = {rid: self.live.rollouts[rid] for rid in rollout_ids if rid in self.live.rollouts}
        for state in out.values():
            self.seen(state)
        missing = [rid for rid in dict.fromkeys(rollout_ids) if rid not in out]
        for rid, state in (await self.load_rollouts(missing)).items():
            out[rid] = self.live.hold(state)
        return out

    async def rollout(self, rollout_id: str) -> RolloutState | None:
        return (await self.rollouts([rollout_id])).get(rollout_id)

    async def worker(self, worker_id: str) -> WorkerRecord:
        """The worker from memory or the read model; a new one when neither has it."""
        kept = self.live.workers.get(worker_id)
        if kept is not None:
            assert isinstance(kept.record, WorkerRecord)
            self.seen(kept)
            return kept.record
        s = await self.reads.record("worker", worker_id)
        if s is None:
            return WorkerRecord(Worker(worker_id=worker_id))
        return self.live.put_worker(worker_record(s)).record  # type: ignore[return-value]

    async def resources(self, resources_id: str) -> ResourcesRecord | None:
        kept = self.live.resources.get(resources_id)
        if kept is not None:
            assert isinstance(kept.record, ResourcesRecord)
            self.seen(kept)
            return kept.record
        s = await self.reads.record("resources", resources_id)
        if s is None:
            return None
        record = resources_record(s)
        self.live.put_resources(record, latest=False)
        return record

    async def span_keys(self, state: RolloutState, attempt_id: str) -> SpanKeys:
        """The span ids and sequence ids the attempt's spans hold."""
        keys = state.spans.get(attempt_id)
        if keys is None:
            ids, sequences = await self.reads.attempt_span_keys(
                state.rollout.rollout_id, attempt_id
            )
            keys = state.spans[attempt_id] = SpanKeys(ids, sequences)
        return keys

    async def sequence_floor(self, state: RolloutState) -> int:
        """The highest span sequence id handed out or seen for the rollout: past everything
        an earlier store (this one before a restart) may have handed out."""
        if state.sequence_floor is None:
            seen = await self.reads.max_span_sequence(state.rollout.rollout_id)
            state.sequence_floor = max(seen, state.record.span_sequence_reserved)
        return state.sequence_floor

    # ---- writing -----------------------------------------------------------------------

    def stage(
        self, records: Sequence[AnyRecord], spans: Sequence[SpanRecorded] = ()
    ) -> list[AnyRecord]:
        """The records' next revisions into memory and, with the spans, into the next
        transaction (under the lock); the call waits for its commit through `answered`.
        Returns the records as written."""
        now = datetime.now(UTC)
        written = [_next_revision(r, now.timestamp()) for r in records]
        # Encoded and checked before anything changes: one call's bad record fails that call,
        # not the transaction it would share with others.
        events = [self.publisher.prepare(*_event(r, now)) for r in written]
        events += [self.publisher.prepare("spans", span) for span in spans]
        for record in events:
            if record.size > self.max_record_bytes:
                raise MessageSizeTooLargeError(
                    f"a record of {record.size} bytes for {record.topic} is over the "
                    f"{self.max_record_bytes} bytes a record may have"
                )
        finished = self.live.finished_version
        holders: list[Holder] = [self.live.put(record) for record in written]
        holders += [self.live.rollouts[span.rollout_id] for span in spans]
        if self.live.finished_version != finished:
            self.finished.set()
            self.finished = asyncio.Event()
        done = self.commits.stage(events)
        for holder in _distinct(holders):
            holder.in_flight += 1
            holder.pending = done
        self._seen.append(done)
        done.add_done_callback(lambda f: self._committed(f, holders))
        if self.live.over() and self._evicting is None:
            self._evicting = asyncio.create_task(self._evict(), name="agl-store-forget")
        return written

    def _committed(self, done: asyncio.Future[list[RecordMetadata]], holders: list[Holder]) -> None:
        metas = None if done.cancelled() or done.exception() else done.result()
        placed: dict[int, dict[Position, int]] = {}
        for i, holder in enumerate(holders):
            offsets = placed.setdefault(id(holder), {})
            if metas is not None:
                m = metas[i]
                place = (m.topic, m.partition)
                offsets[place] = max(offsets.get(place, -1), m.offset)
                self.written[place] = max(self.written.get(place, -1), m.offset)
        for holder in _distinct(holders):
            committed(holder, placed.get(id(holder), {}))

    async def settled(self) -> None:
        """Return once every change staged so far (that a call may have read) is committed."""
        await self.commits.settled()

    def begin(self) -> None:
        """A call begins (under the lock): it has seen nothing yet."""
        self._seen = []

    def seen(self, holder: Holder) -> None:
        if holder.pending is not None:
            self._seen.append(holder.pending)

    def answered(self) -> Commit | None:
        """What the call must wait for before it answers (taken as it leaves the lock): the
        commits of the writes it staged and of those it read, not yet committed. Commits are
        in order, so the last one is enough."""
        waiting = [f for f in self._seen if not f.done()]
        self._seen = []
        return waiting[-1] if waiting else None

    @staticmethod
    async def committed(answered: Commit | None) -> None:
        """Wait for `answered` (raise its failure); a cancelled caller leaves it running."""
        if answered is not None:
            await asyncio.shield(answered)

    async def projected(self, written: Mapping[Position, int] | None = None) -> None:
        """Wait until the read model holds these writes (all the store's, by default)."""
        wanted = dict(self.written if written is None else written)
        if wanted and not await self.watch.offsets(wanted, PROJECTION_WAIT_SECONDS):
            raise TimeoutError(
                f"the read model did not apply the store's writes {wanted} within "
                f"{PROJECTION_WAIT_SECONDS:g} s: is a projector running (`agl-stream worker "
                "projector`)?"
            )

    async def _evict(self) -> None:
        """Forget finished rollouts the projection holds, when memory holds too many."""
        try:
            projected = await self.watch.refresh()
            async with self.lock:
                forgotten = self.live.evict(projected)
            log.debug("the store forgot %d finished record(s) the read model holds", forgotten)
        except Exception:  # forgetting is an economy; a later call tries again
            log.exception("the store could not forget finished records")
        finally:
            self._evicting = None


def _distinct(holders: list[Holder]) -> list[Holder]:
    """Each holder once (they are mutable, so not hashable)."""
    return list({id(h): h for h in holders}.values())


def rollout_record(s: Stored) -> RolloutRecord:
    return RolloutRecord.from_body(s.body, s.revision, s.created_at)


def attempt_record(s: Stored) -> AttemptRecord:
    return AttemptRecord(Attempt.model_validate(s.body["record"]), s.revision, s.created_at)


def worker_record(s: Stored) -> WorkerRecord:
    return WorkerRecord(Worker.model_validate(s.body["record"]), s.revision, s.created_at)


def resources_record(s: Stored) -> ResourcesRecord:
    return ResourcesRecord(
        ResourcesUpdate.model_validate(s.body["record"]), s.revision, s.created_at
    )


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
