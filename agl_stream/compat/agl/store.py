"""`AglStreamStore`: Agent Lightning 0.3's LightningStore over agl-stream's topics and read model.

Every change is an event (AglRecordRevised for rollouts, attempts, workers and resources;
SpanRecorded for spans) written by one fenced writer (core.py) and read back from the
PostgreSQL read model the projector keeps; a restarted store process finds everything there.
The facade's rollouts are not on the tasks topic: agl-stream's runner workers never run them;
Agent Lightning's runners dequeue them from this store.

The store owns an event loop on a thread of its own, so any caller's loop or thread may use
it (Agent Lightning's server thread, runners in threads, a new loop in a test). One store
object belongs to the process that made it: give other processes `agl-stream store`'s URL
and Agent Lightning's LightningStoreClient.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, TypeVar

from agentlightning.store.base import (
    UNSET,
    LightningStore,
    LightningStoreCapabilities,
    LightningStoreStatistics,
    Unset,
)
from agentlightning.types import (
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    EnqueueRolloutRequest,
    NamedResources,
    PaginatedResult,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    RolloutStatus,
    Span,
    TaskInput,
    Worker,
    WorkerStatus,
)
from agentlightning.utils.id import generate_id
from opentelemetry.sdk.trace import ReadableSpan
from pydantic import BaseModel, TypeAdapter

from agl_stream.compat.agl import records as logic
from agl_stream.compat.agl.core import (
    Core,
    attempt_record,
    resources_record,
    rollout_record,
    worker_record,
)
from agl_stream.compat.agl.live import RolloutState
from agl_stream.compat.agl.reads import (
    SPAN_COLUMNS,
    SPAN_SORTS,
    Match,
    page,
    record_field,
    sort_key,
)
from agl_stream.compat.agl.records import (
    AnyRecord,
    AttemptRecord,
    ResourcesRecord,
    RolloutRecord,
    WorkerRecord,
)
from agl_stream.compat.agl.spans import from_row, to_event
from agl_stream.events.ids import require_id
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")
_RESOURCES = TypeAdapter(NamedResources)
SEQUENCES_KEPT = 100_000


class LastUsed(OrderedDict[str, int]):
    """A dict that keeps its `size` most recently written keys."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def __setitem__(self, key: str, value: int) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)


_WAIT_RECHECK_SECONDS = 10.0


def _given(**values: Any) -> dict[str, Any]:
    """The fields an update names: those not left UNSET (None is a value)."""
    return {name: value for name, value in values.items() if not isinstance(value, Unset)}


def _attempted(rollout: Rollout, attempt: Attempt | None) -> Rollout:
    if attempt is None:
        return rollout
    return AttemptedRollout(**rollout.model_dump(), attempt=attempt)


def _ordered(
    items: Sequence[R],
    model_of: Callable[[R], BaseModel],
    ties: Callable[[R], tuple[float, str, str]],
    model: type[BaseModel],
    sort_by: str | None,
    sort_order: Literal["asc", "desc"],
) -> list[R]:
    """Items in the read model's order: by `sort_by` (with Agent Lightning's defaults for
    None), then by when each record was made and its ids, as reads.py orders rows."""
    out = sorted(items, key=ties)
    if sort_by is not None:
        key = sort_key(model, sort_by)
        out.sort(key=lambda item: key(model_of(item)), reverse=sort_order == "desc")
    return out


def _paged(items: list[R], limit: int, offset: int) -> list[R]:
    return items[offset:] if limit == -1 else items[offset : offset + limit]


class AglStreamStore(LightningStore):  # type: ignore[misc]  # Agent Lightning is untyped
    """Agent Lightning's store, durable on agl-stream's Kafka topics and PostgreSQL read model.

    `kafka` and `database` default to the AGL_STREAM_* settings (the embedded stack's when
    unset). `run_projector` runs a projector inside the store (as `agl-stream worker --role
    projector` would; both may run). `scan_debounce_seconds`: how often at most the timeout
    and unresponsive watchdog looks at running rollouts, before a call (0: before each)."""

    def __init__(
        self,
        kafka: KafkaSettings | None = None,
        database: DatabaseSettings | None = None,
        *,
        run_projector: bool = True,
        scan_debounce_seconds: float = 0.0,
    ) -> None:
        super().__init__()
        self.kafka = kafka or KafkaSettings()
        self.database = database or DatabaseSettings()
        self.run_projector = run_projector
        self._scan_debounce_seconds = scan_debounce_seconds
        self._last_scan = 0.0
        self._launch_time = time.time()
        self._pid = os.getpid()
        self._start_lock = threading.Lock()
        self._started: concurrent.futures.Future[Core] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Span sequence ids handed out for rollout ids the store does not hold (Agent
        # Lightning hands them out for any id), for the ones used last.
        self._orphan_sequences: LastUsed = LastUsed(SEQUENCES_KEPT)

    # ---- plumbing ------------------------------------------------------------------------

    @property
    def capabilities(self) -> LightningStoreCapabilities:
        return LightningStoreCapabilities(
            thread_safe=True, async_safe=True, zero_copy=False, otlp_traces=False
        )

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "an AglStreamStore belongs to the process that made it: serve it with "
            "`agl-stream store` and give other processes LightningStoreClient(URL) "
            "(AGENT_LIGHTNING_STORE_URL), or leave AGL_MANAGED_STORE on so that Agent "
            "Lightning's execution strategy serves it"
        )

    def _ensure_loop(self) -> concurrent.futures.Future[Core]:
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"this AglStreamStore was made in process {self._pid} and is used in "
                f"{os.getpid()}: serve it with `agl-stream store` and connect with "
                "LightningStoreClient, or leave AGL_MANAGED_STORE on"
            )
        with self._start_lock:
            if self._started is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=loop.run_forever, name="agl-stream-store", daemon=True
                )
                thread.start()
                self._loop, self._thread = loop, thread
                core = Core(self.kafka, self.database, self.run_projector)

                async def start() -> Core:
                    await core.start()
                    return core

                self._started = asyncio.run_coroutine_threadsafe(start(), loop)
            return self._started

    async def _run(self, work: Callable[[Core], Awaitable[T]]) -> T:
        """Run `work` on the store's loop and wait for it from the caller's loop."""
        started = self._ensure_loop()
        assert self._loop is not None

        async def job() -> T:
            # Once started, the core is taken as it is: waiting on the finished future would
            # cost each call another pass through the store's loop (a self-pipe wake-up).
            if started.done() and not started.cancelled():
                core = started.result()  # (raises what the start raised)
            else:
                core = await asyncio.wrap_future(started)
            return await work(core)

        future = asyncio.run_coroutine_threadsafe(job(), self._loop)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()
            raise

    async def _locked(self, work: Callable[[Core], Awaitable[T]], scan: bool = True) -> T:
        """A call on the live state: decided under the lock (after the watchdog looked),
        answered once everything it may have seen or staged is committed."""

        async def locked(core: Core) -> T:
            async with core.lock:
                await core.ready()
                core.begin()
                if scan:
                    await self._scan(core)
                result = await work(core)
                answered = core.answered()
            await core.committed(answered)
            return result

        return await self._run(locked)

    async def _history(self, work: Callable[[Core], Awaitable[T]]) -> T:
        """A read of the read model: after the watchdog looked, once the projection holds
        every write the store committed."""

        async def read(core: Core) -> T:
            async with core.lock:
                await core.ready()
                await self._scan(core)
            await core.settled()
            await core.projected()
            return await work(core)

        return await self._run(read)

    def close(self) -> None:
        """Stop the store's loop: its projector, producer and connections."""
        with self._start_lock:
            started, loop, thread = self._started, self._loop, self._thread
            self._started = self._loop = self._thread = None
        if started is None or loop is None or thread is None:
            return

        async def stop() -> None:
            try:
                core = await asyncio.wrap_future(started)
            except Exception:  # noqa: BLE001 - it never started; nothing to close
                return
            await core.close()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    # ---- workers, in memory ---------------------------------------------------------------

    async def _worker_synced(
        self, core: Core, attempt: Attempt, now: float, dequeue: bool = False
    ) -> WorkerRecord | None:
        if not attempt.worker_id:
            return None
        w = await core.worker(attempt.worker_id)
        new = logic.worker_after_attempt(w.worker, attempt, now, dequeue)
        return WorkerRecord(new, w.revision, w.created_at)

    async def _existing(self, core: Core, rollout_id: str, missing: str) -> RolloutState:
        state = await core.rollout(rollout_id)
        if state is None:
            raise ValueError(missing)
        return state

    # ---- the watchdog --------------------------------------------------------------------

    async def _scan(self, core: Core) -> None:
        """Running rollouts whose latest attempt timed out or went silent: the attempt is
        marked so and its rollout follows (retried or failed), its worker too."""
        now = time.time()
        if self._scan_debounce_seconds > 0 and now - self._last_scan < self._scan_debounce_seconds:
            return
        self._last_scan = now
        changes: list[AnyRecord] = []
        for rid in list(core.live.running):
            state = core.live.rollouts[rid]
            latest = state.latest()
            if latest is None:
                continue
            status = logic.unhealthy_status(state.rollout, latest.attempt, now)
            if status is None:
                continue
            attempt, sync = logic.with_attempt_changes(latest.attempt, now, {"status": status})
            changes.append(AttemptRecord(attempt, latest.revision, latest.created_at))
            rollout = await logic.rollout_after_attempt(state.record, attempt, attempt, now)
            if rollout is not None:
                changes.append(rollout)
            if sync:
                worker = await self._worker_synced(core, attempt, now)
                if worker is not None:
                    changes.append(worker)
        if changes:
            log.info("the watchdog marked %d attempt(s) timeout or unresponsive", len(changes))
            core.stage(_merge(changes))

    # ---- statistics ----------------------------------------------------------------------

    async def statistics(self) -> LightningStoreStatistics:
        async def work(core: Core) -> LightningStoreStatistics:
            counts = await core.reads.counts()
            return {
                "name": type(self).__name__,
                "total_rollouts": counts.get("rollout", 0),
                "total_attempts": counts.get("attempt", 0),
                "total_spans": counts.get("span", 0),
                "total_resources": counts.get("resources", 0),
                "total_workers": counts.get("worker", 0),
                "uptime": time.time() - self._launch_time,
            }

        return await self._history(work)

    # ---- rollouts: queue and start -------------------------------------------------------

    def _new_rollout(
        self,
        input: TaskInput,
        mode: Literal["train", "val", "test"] | None,
        resources_id: str | None,
        config: RolloutConfig | None,
        metadata: dict[str, Any] | None,
        status: RolloutStatus,
        now: float,
    ) -> RolloutRecord:
        rollout = Rollout(
            rollout_id="ro-" + generate_id(12),
            input=input,
            start_time=now,
            mode=mode,
            resources_id=resources_id,
            status=status,
            config=config.model_copy(deep=True) if config is not None else RolloutConfig(),
            metadata=dict(metadata) if metadata is not None else {},
        )
        return RolloutRecord(
            rollout,
            queued_at=now if status in logic.QUEUING else None,
            span_sequence_reserved=logic.SEQUENCE_BLOCK,
        )

    async def start_rollout(
        self,
        input: TaskInput,
        mode: Literal["train", "val", "test"] | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
        worker_id: str | None = None,
    ) -> AttemptedRollout:
        # resources_id "": the latest; worker_id "": none
        _check_ids(resources_id=resources_id or None, worker_id=worker_id or None)

        async def work(core: Core) -> AttemptedRollout:
            now = time.time()
            resolved = resources_id or core.live.latest_resources
            record = self._new_rollout(input, mode, resolved, config, metadata, "preparing", now)
            attempt = Attempt(
                rollout_id=record.rollout.rollout_id,
                attempt_id="at-" + generate_id(8),
                sequence_id=1,
                start_time=now,
                status="preparing",
                worker_id=worker_id,
            )
            changes: list[AnyRecord] = [record, AttemptRecord(attempt)]
            worker = await self._worker_synced(core, attempt, now)
            if worker is not None:
                changes.append(worker)
            core.stage(changes)
            return AttemptedRollout(**record.rollout.model_dump(), attempt=attempt)

        return await self._locked(work)

    async def enqueue_rollout(
        self,
        input: TaskInput,
        mode: Literal["train", "val", "test"] | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Rollout:
        request = EnqueueRolloutRequest(
            input=input, mode=mode, resources_id=resources_id, config=config, metadata=metadata
        )
        return (await self.enqueue_many_rollouts([request]))[0]

    async def enqueue_many_rollouts(
        self, rollouts: Sequence[EnqueueRolloutRequest]
    ) -> Sequence[Rollout]:
        _check_ids(resources_id=[r.resources_id for r in rollouts if r.resources_id])

        async def work(core: Core) -> list[Rollout]:
            now = time.time()
            latest = core.live.latest_resources
            made = [
                self._new_rollout(
                    r.input,
                    r.mode,
                    r.resources_id or latest,
                    r.config,
                    r.metadata,
                    "queuing",
                    now + i * 1e-6,  # distinct queue places, in the given order
                )
                for i, r in enumerate(rollouts)
            ]
            if made:
                core.stage(made)
            return [m.rollout for m in made]

        return await self._locked(work, scan=False)

    @staticmethod
    def _claim(
        state: RolloutState, worker_id: str | None, now: float
    ) -> tuple[AttemptedRollout, list[AnyRecord]]:
        """A new attempt of a rollout (sequence id one past the ones it has), the rollout
        preparing and out of the queue."""
        attempt = Attempt(
            rollout_id=state.rollout.rollout_id,
            attempt_id="at-" + generate_id(8),
            sequence_id=len(state.attempts) + 1,
            start_time=now,
            status="preparing",
            worker_id=worker_id,
        )
        rollout = logic.with_rollout_status(state.record, "preparing", now)
        return (
            AttemptedRollout(**rollout.rollout.model_dump(), attempt=attempt),
            [rollout, AttemptRecord(attempt)],
        )

    async def dequeue_rollout(self, worker_id: str | None = None) -> AttemptedRollout | None:
        found = await self.dequeue_many_rollouts(limit=1, worker_id=worker_id)
        return found[0] if found else None

    async def dequeue_many_rollouts(
        self, *, limit: int = 1, worker_id: str | None = None
    ) -> Sequence[AttemptedRollout]:
        _check_ids(worker_id=worker_id)

        async def work(core: Core) -> list[AttemptedRollout]:
            now = time.time()
            claimed: list[AttemptedRollout] = []
            changes: list[AnyRecord] = []
            for state in core.live.queued(max(limit, 0)):
                attempted, records = self._claim(state, worker_id, now)
                claimed.append(attempted)
                changes += records
            if worker_id is not None:
                w = await core.worker(worker_id)
                if claimed:
                    # One worker works on one attempt: the last one claimed.
                    worker = logic.worker_after_attempt(w.worker, claimed[-1].attempt, now, True)
                else:
                    worker = logic.worker_after_empty_dequeue(w.worker, now)
                changes.append(WorkerRecord(worker, w.revision, w.created_at))
            if changes:
                core.stage(changes)
            return claimed

        return await self._locked(work)

    async def start_attempt(
        self, rollout_id: str, worker_id: str | None = None
    ) -> AttemptedRollout:
        _check_ids(rollout_id=rollout_id, worker_id=worker_id)

        async def work(core: Core) -> AttemptedRollout:
            state = await self._existing(core, rollout_id, f"Rollout {rollout_id} not found")
            now = time.time()
            attempted, changes = self._claim(state, worker_id, now)
            worker = await self._worker_synced(core, attempted.attempt, now)
            if worker is not None:
                changes.append(worker)
            core.stage(changes)
            return attempted

        return await self._locked(work)

    # ---- rollouts: reading ---------------------------------------------------------------

    async def query_rollouts(
        self,
        *,
        status_in: Sequence[RolloutStatus] | None = None,
        rollout_id_in: Sequence[str] | None = None,
        rollout_id_contains: str | None = None,
        filter_logic: Literal["and", "or"] = "and",
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
        status: Sequence[RolloutStatus] | None = None,
        rollout_ids: Sequence[str] | None = None,
    ) -> PaginatedResult[Rollout]:
        if status_in is None and status is not None:
            warnings.warn(
                "status is deprecated, use status_in instead", DeprecationWarning, stacklevel=2
            )
            status_in = status
        if rollout_id_in is None and rollout_ids is not None:
            warnings.warn(
                "rollout_ids is deprecated, use rollout_id_in instead",
                DeprecationWarning,
                stacklevel=2,
            )
            rollout_id_in = rollout_ids
        _check_ids(rollout_id_in=rollout_id_in, rollout_id_contains=rollout_id_contains)
        page(limit, offset)  # refuses a negative offset or limit before anything is read
        if sort_by is not None:
            sort_key(Rollout, sort_by)  # refuses a field that does not sort
        others = rollout_id_contains is not None or status_in is not None
        if rollout_id_in is not None and (filter_logic == "and" or not others):
            ids, contains, statuses = list(rollout_id_in), rollout_id_contains, status_in

            async def live(core: Core) -> PaginatedResult[Rollout]:
                states = await core.rollouts(ids)
                chosen = [
                    s
                    for s in states.values()
                    if (contains is None or contains in s.rollout.rollout_id)
                    and (statuses is None or s.rollout.status in statuses)
                ]
                ordered = _ordered(
                    chosen,
                    lambda s: s.rollout,
                    lambda s: (s.record.created_at, s.rollout.rollout_id, s.rollout.rollout_id),
                    Rollout,
                    sort_by,
                    sort_order,
                )
                items = [s.attempted() for s in _paged(ordered, limit, offset)]
                return PaginatedResult(items=items, limit=limit, offset=offset, total=len(chosen))

            return await self._locked(live)

        matches = [Match("record_id", within=rollout_id_in, contains=rollout_id_contains)]
        if status_in is not None:
            matches.append(Match(record_field("status"), within=status_in))

        async def work(core: Core) -> PaginatedResult[Rollout]:
            rows, total = await core.reads.records(
                "rollout",
                Rollout,
                matches=matches,
                logic=filter_logic,
                sort_by=sort_by,
                sort_order=sort_order,
                limit=limit,
                offset=offset,
            )
            rollouts = [rollout_record(r).rollout for r in rows]
            latest = await core.reads.latest_attempts([r.rollout_id for r in rollouts])
            items = [
                _attempted(r, attempt_record(latest[r.rollout_id]).attempt)
                if r.rollout_id in latest
                else r
                for r in rollouts
            ]
            return PaginatedResult(items=items, limit=limit, offset=offset, total=total)

        return await self._history(work)

    async def get_rollout_by_id(self, rollout_id: str) -> Rollout | None:
        _check_ids(rollout_id=rollout_id)

        async def work(core: Core) -> Rollout | None:
            state = await core.rollout(rollout_id)
            return None if state is None else state.attempted()

        return await self._locked(work)

    async def query_attempts(
        self,
        rollout_id: str,
        *,
        sort_by: str | None = "sequence_id",
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> PaginatedResult[Attempt]:
        _check_ids(rollout_id=rollout_id)
        page(limit, offset)
        if sort_by is not None:
            sort_key(Attempt, sort_by)

        async def work(core: Core) -> PaginatedResult[Attempt]:
            state = await core.rollout(rollout_id)
            attempts = [] if state is None else list(state.attempts.values())
            ordered = _ordered(
                attempts,
                lambda a: a.attempt,
                lambda a: (a.created_at, rollout_id, a.attempt.attempt_id),
                Attempt,
                sort_by,
                sort_order,
            )
            items = [a.attempt for a in _paged(ordered, limit, offset)]
            return PaginatedResult(items=items, limit=limit, offset=offset, total=len(attempts))

        return await self._locked(work)

    async def get_latest_attempt(self, rollout_id: str) -> Attempt | None:
        _check_ids(rollout_id=rollout_id)

        async def work(core: Core) -> Attempt | None:
            state = await core.rollout(rollout_id)
            latest = None if state is None else state.latest()
            return None if latest is None else latest.attempt

        return await self._locked(work)

    async def wait_for_rollouts(
        self,
        *,
        rollout_ids: list[str],
        timeout: float | None = None,  # noqa: ASYNC109 - Agent Lightning's signature
    ) -> list[Rollout]:
        """The rollouts among these that are finished, in the order given, waiting (woken
        when the store finishes a rollout, never polling in a loop) until all are or
        `timeout` seconds pass."""
        _check_ids(rollout_ids=rollout_ids)

        async def work(core: Core) -> list[Rollout]:
            loop = asyncio.get_running_loop()
            deadline = None if timeout is None else loop.time() + timeout
            while True:
                async with core.lock:
                    await core.ready()
                    core.begin()
                    await self._scan(core)
                    states = await core.rollouts(rollout_ids)
                    finished = core.finished
                    answered = core.answered()
                done = [
                    states[rid].rollout
                    for rid in rollout_ids
                    if rid in states and states[rid].rollout.status in logic.FINISHED
                ]
                left = _WAIT_RECHECK_SECONDS if deadline is None else deadline - loop.time()
                if len(done) == len(rollout_ids) or left <= 0:
                    await core.committed(answered)
                    return done
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(finished.wait(), min(left, _WAIT_RECHECK_SECONDS))

        return await self._run(work)

    async def update_rollout(
        self,
        rollout_id: str,
        input: TaskInput | Unset = UNSET,
        mode: Literal["train", "val", "test"] | Unset | None = UNSET,
        resources_id: str | Unset | None = UNSET,
        status: RolloutStatus | Unset = UNSET,
        config: RolloutConfig | Unset = UNSET,
        metadata: dict[str, Any] | Unset | None = UNSET,
    ) -> Rollout:
        given = _given(
            input=input, mode=mode, resources_id=resources_id, status=status, config=config,
            metadata=metadata,
        )  # fmt: skip
        _check_ids(rollout_id=rollout_id, resources_id=resources_id)

        async def work(core: Core) -> Rollout:
            state = await self._existing(
                core, rollout_id, f"Item rollout_id={rollout_id!r} does not exist in the store"
            )
            new = logic.updated_rollout(state.record, time.time(), dict(given))
            (written,) = core.stage([new])
            assert isinstance(written, RolloutRecord)
            return written.rollout

        return await self._locked(work)

    # ---- attempts --------------------------------------------------------------------------

    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str | Literal["latest"],
        status: AttemptStatus | Unset = UNSET,
        worker_id: str | Unset = UNSET,
        last_heartbeat_time: float | Unset = UNSET,
        metadata: dict[str, Any] | Unset | None = UNSET,
    ) -> Attempt:
        given = _given(
            status=status, worker_id=worker_id, last_heartbeat_time=last_heartbeat_time,
            metadata=metadata,
        )  # fmt: skip
        # worker_id "" takes the attempt from its worker, as Agent Lightning's stores do
        _check_ids(rollout_id=rollout_id, attempt_id=attempt_id, worker_id=worker_id or None)

        async def work(core: Core) -> Attempt:
            state = await self._existing(core, rollout_id, f"Rollout {rollout_id} not found")
            latest = state.latest()
            if latest is None:
                raise ValueError(f"No attempts found for rollout {rollout_id}")
            target = latest if attempt_id == "latest" else state.attempts.get(attempt_id)
            if target is None:
                raise ValueError(f"Attempt {attempt_id} not found for rollout {rollout_id}")
            now = time.time()
            attempt, sync = logic.with_attempt_changes(target.attempt, now, given)
            changes: list[AnyRecord] = [AttemptRecord(attempt, target.revision, target.created_at)]
            rollout = await logic.rollout_after_attempt(state.record, attempt, latest.attempt, now)
            if rollout is not None:
                changes.append(rollout)
            if sync:
                worker = await self._worker_synced(core, attempt, now)
                if worker is not None:
                    changes.append(worker)
            core.stage(changes)
            return attempt

        return await self._locked(work)

    # ---- spans -----------------------------------------------------------------------------

    async def _next_sequences(self, core: Core, rollout_ids: Sequence[str]) -> list[int]:
        """Sequence ids, strictly increasing per rollout; a rollout's record reserves blocks
        of them, so a restarted store never hands out one twice (it skips the rest of the
        block)."""
        out: list[int] = []
        reserve: dict[str, RolloutRecord] = {}
        for rollout_id in rollout_ids:
            state = await core.rollout(rollout_id)
            if state is None:  # Agent Lightning hands them out for any rollout id
                floor = self._orphan_sequences.get(rollout_id)
                if floor is None:
                    floor = await core.reads.max_span_sequence(rollout_id)
                self._orphan_sequences[rollout_id] = floor + 1
                out.append(floor + 1)
                continue
            floor = await core.sequence_floor(state)
            state.sequence_floor = floor + 1
            out.append(floor + 1)
            record = reserve.get(rollout_id, state.record)
            if floor + 1 > record.span_sequence_reserved:
                reserve[rollout_id] = logic.replace_reserved(
                    record, floor + 1 + logic.SEQUENCE_BLOCK
                )
        if reserve:
            core.stage(list(reserve.values()))
        return out

    async def get_next_span_sequence_id(self, rollout_id: str, attempt_id: str) -> int:
        return (await self.get_many_span_sequence_ids([(rollout_id, attempt_id)]))[0]

    async def get_many_span_sequence_ids(
        self, rollout_attempt_ids: Sequence[tuple[str, str]]
    ) -> Sequence[int]:
        _check_ids(
            rollout_id=[r for r, _ in rollout_attempt_ids],
            attempt_id=[a for _, a in rollout_attempt_ids],
        )

        async def work(core: Core) -> list[int]:
            return await self._next_sequences(core, [r for r, _ in rollout_attempt_ids])

        return await self._locked(work, scan=False)

    async def add_span(self, span: Span) -> Span | None:
        added = await self.add_many_spans([span])
        return added[0] if added else None

    async def add_otel_span(
        self,
        rollout_id: str,
        attempt_id: str,
        readable_span: ReadableSpan,
        sequence_id: int | None = None,
    ) -> Span | None:
        _check_ids(rollout_id=rollout_id, attempt_id=attempt_id)

        async def work(core: Core) -> Span | None:
            seq = sequence_id
            if seq is None:
                seq = (await self._next_sequences(core, [rollout_id]))[0]
            span = Span.from_opentelemetry(
                readable_span, rollout_id=rollout_id, attempt_id=attempt_id, sequence_id=seq
            )
            added = await self._add_spans(core, [span])
            return added[0] if added else None

        return await self._locked(work, scan=False)

    async def add_many_spans(self, spans: Sequence[Span]) -> Sequence[Span]:
        _check_ids(
            rollout_id=[s.rollout_id for s in spans], attempt_id=[s.attempt_id for s in spans]
        )

        async def work(core: Core) -> list[Span]:
            return await self._add_spans(core, spans)

        return await self._locked(work, scan=False)

    async def _add_spans(self, core: Core, spans: Sequence[Span]) -> list[Span]:
        """Spans of existing attempts, duplicates (same span id, or same sequence id, in one
        attempt) left out with an error logged; each attempt's heartbeat, and a preparing
        rollout running."""
        by_attempt: dict[tuple[str, str], list[Span]] = {}
        for span in spans:
            by_attempt.setdefault((span.rollout_id, span.attempt_id), []).append(span)
        added: list[tuple[RolloutState, Span]] = []
        changes: list[AnyRecord] = []
        now = time.time()
        for (rollout_id, attempt_id), group in by_attempt.items():
            state = await self._existing(core, rollout_id, f"Rollout {rollout_id} not found")
            target = state.attempts.get(attempt_id)
            if target is None:
                raise ValueError(f"Attempt {attempt_id} not found for rollout {rollout_id}")
            keys = await core.span_keys(state, attempt_id)
            await core.sequence_floor(state)
            ids, seqs = set(keys.ids), set(keys.sequences)
            fresh: list[Span] = []
            for span in group:
                if span.span_id in ids or span.sequence_id in seqs:
                    log.error(
                        "Duplicated span added for rollout=%s, attempt=%s, span=%s. Skipping.",
                        rollout_id,
                        attempt_id,
                        span.span_id,
                    )
                    continue
                ids.add(span.span_id)
                seqs.add(span.sequence_id)
                fresh.append(span)
            if not fresh:
                continue
            added += [(state, s) for s in fresh]
            attempt = logic.heartbeat(target.attempt, now)
            changes.append(AttemptRecord(attempt, target.revision, target.created_at))
            latest = state.latest()
            rollout = logic.rollout_after_heartbeat(
                state.record, attempt, None if latest is None else latest.attempt, now
            )
            if rollout is not None:
                changes.append(rollout)
        if not added:
            return []
        events = [to_event(s) for _, s in added]  # refuses what cannot be kept, before any change
        core.stage(changes, events)
        for state, span in added:
            keys = state.spans[span.attempt_id]
            keys.ids.add(span.span_id)
            keys.sequences.add(span.sequence_id)
            state.sequence_floor = max(state.sequence_floor or 0, span.sequence_id)
        return [s for _, s in added]

    async def query_spans(
        self,
        rollout_id: str,
        attempt_id: str | Literal["latest"] | None = None,
        *,
        trace_id: str | None = None,
        trace_id_contains: str | None = None,
        span_id: str | None = None,
        span_id_contains: str | None = None,
        parent_id: str | None = None,
        parent_id_contains: str | None = None,
        name: str | None = None,
        name_contains: str | None = None,
        filter_logic: Literal["and", "or"] = "and",
        limit: int = -1,
        offset: int = 0,
        sort_by: str | None = "sequence_id",
        sort_order: Literal["asc", "desc"] = "asc",
    ) -> PaginatedResult[Span]:
        _check_ids(
            rollout_id=rollout_id, attempt_id=attempt_id, trace_id=trace_id,
            trace_id_contains=trace_id_contains, span_id=span_id,
            span_id_contains=span_id_contains, parent_id=parent_id,
            parent_id_contains=parent_id_contains,
        )  # fmt: skip
        if sort_by is not None and sort_by not in SPAN_SORTS:
            raise ValueError(
                f"cannot sort spans by {sort_by!r}: use one of {', '.join(SPAN_SORTS)}"
            )
        given = {
            "trace_id": (trace_id, trace_id_contains),
            "span_id": (span_id, span_id_contains),
            "parent_id": (parent_id, parent_id_contains),
            "name": (name, name_contains),
        }
        matches = [
            Match(SPAN_COLUMNS[field], exact=exact, contains=contains)
            for field, (exact, contains) in given.items()
        ]

        async def work(core: Core) -> PaginatedResult[Span]:
            # The rollout's spans from the read model, once it holds the rollout's writes.
            async with core.lock:
                await core.ready()
                core.begin()
                state = await core.rollout(rollout_id)
                answered = core.answered()
            await core.committed(answered)
            resolved = attempt_id
            if state is not None:
                await core.projected(state.written)
                if attempt_id == "latest":
                    latest = state.latest()
                    resolved = None if latest is None else latest.attempt.attempt_id
            elif attempt_id == "latest":
                resolved = None
            if attempt_id == "latest" and resolved is None:
                return PaginatedResult(items=[], limit=limit, offset=offset, total=0)
            rows, total = await core.reads.spans(
                rollout_id,
                resolved,
                matches,
                filter_logic,
                None if sort_by is None else SPAN_SORTS[sort_by],
                sort_order,
                limit,
                offset,
            )
            items = [from_row(r) for r in rows]
            return PaginatedResult(items=items, limit=limit, offset=offset, total=total)

        return await self._run(work)

    # ---- resources -------------------------------------------------------------------------

    async def add_resources(self, resources: NamedResources) -> ResourcesUpdate:
        return await self._put_resources("rs-" + generate_id(12), resources, new=True)

    async def update_resources(
        self, resources_id: str, resources: NamedResources
    ) -> ResourcesUpdate:
        return await self._put_resources(resources_id, resources, new=False)

    async def _put_resources(
        self, resources_id: str, resources: NamedResources, new: bool
    ) -> ResourcesUpdate:
        _check_ids(resources_id=resources_id)
        checked = _RESOURCES.validate_python(resources)

        async def work(core: Core) -> ResourcesUpdate:
            now = time.time()
            old = None if new else await core.resources(resources_id)
            if old is None:
                record = ResourcesRecord(
                    ResourcesUpdate(
                        resources_id=resources_id,
                        resources=checked,
                        create_time=now,
                        update_time=now,
                        version=1,
                    )
                )
            else:
                update = old.update.model_copy(
                    update={
                        "resources": checked,
                        "update_time": max(now, old.update.update_time + 1e-6),
                        "version": old.update.version + 1,
                    }
                )
                record = ResourcesRecord(update, old.revision, old.created_at)
            core.stage([record])
            return record.update

        return await self._locked(work, scan=False)

    async def get_resources_by_id(self, resources_id: str) -> ResourcesUpdate | None:
        _check_ids(resources_id=resources_id)

        async def work(core: Core) -> ResourcesUpdate | None:
            found = await core.resources(resources_id)
            return None if found is None else found.update

        return await self._locked(work, scan=False)

    async def get_latest_resources(self) -> ResourcesUpdate | None:
        async def work(core: Core) -> ResourcesUpdate | None:
            latest = core.live.latest_resources
            found = None if latest is None else await core.resources(latest)
            return None if found is None else found.update

        return await self._locked(work, scan=False)

    async def query_resources(
        self,
        *,
        resources_id: str | None = None,
        resources_id_contains: str | None = None,
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> PaginatedResult[ResourcesUpdate]:
        # Both filters must hold (Agent Lightning takes no filter logic here).
        must, params = [], []
        _check_ids(resources_id=resources_id, resources_id_contains=resources_id_contains)
        if resources_id is not None:
            must.append("record_id = {}")
            params.append(resources_id)
        if resources_id_contains is not None:
            must.append("strpos(record_id, {}) > 0")
            params.append(resources_id_contains)

        async def work(core: Core) -> PaginatedResult[ResourcesUpdate]:
            rows, total = await core.reads.records(
                "resources",
                ResourcesUpdate,
                must=must,
                must_params=params,
                sort_by=sort_by,
                sort_order=sort_order,
                limit=limit,
                offset=offset,
            )
            items = [resources_record(r).update for r in rows]
            return PaginatedResult(items=items, limit=limit, offset=offset, total=total)

        return await self._history(work)

    # ---- workers ---------------------------------------------------------------------------

    async def update_worker(
        self, worker_id: str, heartbeat_stats: dict[str, Any] | Unset = UNSET
    ) -> Worker:
        _check_ids(worker_id=worker_id)
        updates: dict[str, Any] = {}
        if not isinstance(heartbeat_stats, Unset):
            updates["heartbeat_stats"] = dict(heartbeat_stats)  # None: TypeError, as in AGL

        async def work(core: Core) -> Worker:
            w = await core.worker(worker_id)
            worker = w.worker.model_copy(update={**updates, "last_heartbeat_time": time.time()})
            core.stage([WorkerRecord(worker, w.revision, w.created_at)])
            return worker

        return await self._locked(work, scan=False)

    async def get_worker_by_id(self, worker_id: str) -> Worker | None:
        _check_ids(worker_id=worker_id)

        async def work(core: Core) -> Worker | None:
            w = await core.worker(worker_id)
            return None if w.revision == 0 else w.worker

        return await self._locked(work, scan=False)

    async def query_workers(
        self,
        *,
        status_in: Sequence[WorkerStatus] | None = None,
        worker_id_contains: str | None = None,
        filter_logic: Literal["and", "or"] = "and",
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> PaginatedResult[Worker]:
        _check_ids(worker_id_contains=worker_id_contains)
        matches = [
            Match(record_field("status"), within=status_in),
            Match("record_id", contains=worker_id_contains),
        ]

        async def work(core: Core) -> PaginatedResult[Worker]:
            rows, total = await core.reads.records(
                "worker",
                Worker,
                matches=matches,
                logic=filter_logic,
                sort_by=sort_by,
                sort_order=sort_order,
                limit=limit,
                offset=offset,
            )
            items = [worker_record(r).worker for r in rows]
            return PaginatedResult(items=items, limit=limit, offset=offset, total=total)

        return await self._history(work)


def _check_ids(**given: object) -> None:
    """ValueError (a 400 over HTTP) naming the first given id that breaks agl-stream's id rule
    (agl_stream.events.ids): ids come from callers, and one with a NUL would fail PostgreSQL's
    lookup, one of 300 characters the event that carries it. None and UNSET are not given; a
    list's items are checked each; a part of an id (`*_contains`) may also be empty."""
    for name, value in given.items():
        if value is None or isinstance(value, Unset):
            continue
        for item in value if isinstance(value, list | tuple) else [value]:
            if name.endswith("_contains"):
                _checked_part(name, item)
            else:
                require_id(name, item)


def _checked_part(name: str, value: Any) -> None:
    if value != "":
        require_id(name, value)


def _merge(changes: list[AnyRecord]) -> list[AnyRecord]:
    """One revision per record: a later change of a record replaces an earlier one."""
    out: dict[tuple[str, str, str], AnyRecord] = {}
    for c in changes:
        out[_identity(c)] = c
    return list(out.values())


def _identity(record: AnyRecord) -> tuple[str, str, str]:
    if isinstance(record, RolloutRecord):
        return ("rollout", record.rollout.rollout_id, record.rollout.rollout_id)
    if isinstance(record, AttemptRecord):
        return ("attempt", record.attempt.rollout_id, record.attempt.attempt_id)
    if isinstance(record, WorkerRecord):
        return ("worker", "", record.worker.worker_id)
    return ("resources", "", record.update.resources_id)
