"""Events to rows: pure, commutative and idempotent (no I/O here).

`project(events, state)` folds a batch into the rows it touches. The projector loads those
rows, calls it, and writes what changed; a unit test proves that any order, any split into
batches and any duplication of the same events ends in the same rows.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TypeVar

from agl_stream.events import (
    AglRecordRevised,
    AttemptFinished,
    AttemptStarted,
    ErrorInfo,
    Event,
    ResourcesPublished,
    RewardRecorded,
    RolloutCancelled,
    RolloutFinished,
    RolloutQueued,
    SpanRecorded,
    WorkerHeartbeat,
)
from agl_stream.projection.rows import (
    AglRecordRow,
    AttemptRow,
    ResourcesRow,
    RewardRow,
    RolloutRow,
    SpanRow,
    WorkerRow,
    evolve,
)

AttemptKey = tuple[str, str]
AglKey = tuple[str, str, str]  # kind, rollout id ('' for workers and resources), record id
K = TypeVar("K")
V = TypeVar("V")


@dataclass
class State:
    """The rows a batch may touch, as loaded (and then as folded)."""

    rollouts: dict[str, RolloutRow] = field(default_factory=dict)
    attempts: dict[AttemptKey, AttemptRow] = field(default_factory=dict)  # all of each rollout
    resources: dict[str, ResourcesRow] = field(default_factory=dict)
    workers: dict[str, WorkerRow] = field(default_factory=dict)
    agl_records: dict[AglKey, AglRecordRow] = field(default_factory=dict)


@dataclass
class Changes:
    """Rows to upsert; spans to insert when absent (first recorded wins)."""

    rollouts: list[RolloutRow] = field(default_factory=list)
    attempts: list[AttemptRow] = field(default_factory=list)
    # SpanRows, or bytes: a row already as a binary COPY tuple (copy_binary).
    spans: list[SpanRow | bytes] = field(default_factory=list)
    resources: list[ResourcesRow] = field(default_factory=list)
    workers: list[WorkerRow] = field(default_factory=list)
    rewards: list[RewardRow] = field(default_factory=list)  # inserted when absent
    agl_records: list[AglRecordRow] = field(default_factory=list)

    def __len__(self) -> int:
        return sum(
            len(x)
            for x in (
                self.rollouts, self.attempts, self.spans, self.resources, self.workers,
                self.rewards, self.agl_records,
            )
        )  # fmt: skip


@dataclass(frozen=True)
class Keys:
    """What a batch needs loaded."""

    rollouts: frozenset[str]
    resources: frozenset[str]
    workers: frozenset[str]
    agl_records: frozenset[AglKey] = frozenset()


_LIFECYCLE = (
    RolloutQueued, RolloutCancelled, AttemptStarted, AttemptFinished, RolloutFinished,
    RewardRecorded,
)  # fmt: skip


def keys(events: Iterable[Event]) -> Keys:
    rollouts, resources, workers = set(), set(), set()
    agl: set[AglKey] = set()
    for event in events:
        if isinstance(event, AglRecordRevised):
            agl.add(agl_key(event))
        elif isinstance(event, _LIFECYCLE):
            rollouts.add(event.rollout_id)
        elif isinstance(event, ResourcesPublished):
            resources.add(event.resources_id)
        elif isinstance(event, WorkerHeartbeat):
            workers.add(event.worker_id)
    return Keys(frozenset(rollouts), frozenset(resources), frozenset(workers), frozenset(agl))


def project(events: Iterable[Event], state: State) -> Changes:
    """Fold the events into `state` (in place) and return the rows that changed."""
    before = State(
        dict(state.rollouts),
        dict(state.attempts),
        dict(state.resources),
        dict(state.workers),
        dict(state.agl_records),
    )
    spans: list[SpanRow | bytes] = []
    rewards: list[RewardRow] = []
    touched: set[str] = set()
    for event in events:
        if isinstance(event, SpanRecorded):
            spans.append(span_row(event))
        elif isinstance(event, AttemptStarted | AttemptFinished):
            key = (event.rollout_id, event.attempt_id)
            state.attempts[key] = apply_attempt(state.attempts.get(key), event)
            touched.add(event.rollout_id)
            if isinstance(event, AttemptStarted) and event.task is not None:
                rid = event.rollout_id
                row = state.rollouts.get(rid) or RolloutRow(rid, "queuing")
                state.rollouts[rid] = apply_task(row, event)
        elif isinstance(event, RewardRecorded):
            rewards.append(reward_row(event))
        elif isinstance(event, RolloutQueued | RolloutCancelled | RolloutFinished):
            row = state.rollouts.get(event.rollout_id) or RolloutRow(event.rollout_id, "queuing")
            state.rollouts[event.rollout_id] = apply_rollout(row, event)
            touched.add(event.rollout_id)
        elif isinstance(event, ResourcesPublished):
            state.resources[event.resources_id] = apply_resources(
                state.resources.get(event.resources_id), event
            )
        elif isinstance(event, WorkerHeartbeat):
            state.workers[event.worker_id] = apply_heartbeat(
                state.workers.get(event.worker_id), event
            )
        elif isinstance(event, AglRecordRevised):
            record = agl_key(event)
            state.agl_records[record] = apply_agl_record(state.agl_records.get(record), event)
    by_rollout: dict[str, list[AttemptRow]] = {}
    for (rollout_id, _), attempt in state.attempts.items():
        by_rollout.setdefault(rollout_id, []).append(attempt)
    for rollout_id in touched:
        row = state.rollouts.get(rollout_id) or RolloutRow(rollout_id, "queuing")
        state.rollouts[rollout_id] = derive(row, by_rollout.get(rollout_id, []))
    return Changes(
        rollouts=_changed(before.rollouts, state.rollouts),
        attempts=_changed(before.attempts, state.attempts),
        spans=spans,
        resources=_changed(before.resources, state.resources),
        workers=_changed(before.workers, state.workers),
        rewards=rewards,
        agl_records=_changed(before.agl_records, state.agl_records),
    )


def _changed(before: dict[K, V], after: dict[K, V]) -> list[V]:
    return [row for key, row in after.items() if before.get(key) != row]


def _first(event: Event, at: datetime | None, event_id: uuid.UUID | None) -> bool:
    """Does the event come before the one in a slot (by occurred_at, then event id)?"""
    if at is None or event_id is None:
        return True
    return (event.occurred_at, event.event_id) < (at, event_id)


def _error(error: ErrorInfo | None) -> dict[str, str | None] | None:
    return None if error is None else error.model_dump()


# ---- rollouts --------------------------------------------------------------------------------


def apply_rollout(
    row: RolloutRow, event: RolloutQueued | RolloutCancelled | RolloutFinished
) -> RolloutRow:
    if isinstance(event, RolloutQueued):
        newer = event.attempt_number > row.queued_attempt
        if newer or (
            event.attempt_number == row.queued_attempt
            and _first(event, row.queued_at, row.queued_event_id)
        ):
            return evolve(
                row,
                mode=event.mode.value,
                input=json.loads(event.input_json),
                resources_id=event.resources_id,
                metadata=dict(event.metadata),
                timeout_seconds=event.timeout_seconds,
                unresponsive_seconds=event.unresponsive_seconds,
                max_attempts=event.max_attempts,
                retry_condition=[s.value for s in event.retry_condition],
                first_queued_at=event.first_queued_at,
                queued_attempt=event.attempt_number,
                queued_at=event.occurred_at,
                queued_event_id=event.event_id,
            )
        return row
    if isinstance(event, RolloutCancelled):
        if _first(event, row.cancel_requested_at, row.cancel_event_id):
            return evolve(
                row,
                cancel_requested_at=event.occurred_at,
                cancel_reason=event.reason,
                cancel_requested_by=event.requested_by,
                cancel_event_id=event.event_id,
            )
        return row
    if _first(event, row.finished_at, row.finished_event_id):
        return evolve(
            row,
            finished_status=event.status.value,
            finished_at=event.occurred_at,
            finished_attempt_id=event.attempt_id,
            finished_attempt_count=event.attempt_count,
            finished_error=_error(event.error),
            finished_event_id=event.event_id,
        )
    return row


def apply_task(row: RolloutRow, event: AttemptStarted) -> RolloutRow:
    """An attempt nobody queued (a gateway session, an ingested trace) gives its rollout the
    task a RolloutQueued would have: the earliest such attempt's, and only while no
    RolloutQueued is folded (queued attempt 0), which always wins."""
    task = event.task
    if task is None or row.queued_attempt > 0:
        return row
    if not _first(event, row.queued_at, row.queued_event_id):
        return row
    return evolve(
        row,
        mode=task.mode.value,
        input=json.loads(task.input_json),
        metadata=dict(task.metadata),
        first_queued_at=event.occurred_at,
        queued_at=event.occurred_at,
        queued_event_id=event.event_id,
    )


def derive(row: RolloutRow, attempts: list[AttemptRow]) -> RolloutRow:
    """The columns that follow from the rollout's own facts and its attempts."""
    latest = max(attempts, key=_attempt_order, default=None)
    final = latest
    if row.finished_attempt_id is not None:
        final = next((a for a in attempts if a.attempt_id == row.finished_attempt_id), latest)
    times = [row.queued_at, row.cancel_requested_at, row.finished_at]
    for attempt in attempts:
        times += [attempt.started_at, attempt.finished_at]
    present = [t for t in times if t is not None]
    started = [a.started_at for a in attempts if a.started_at is not None]
    return evolve(
        row,
        status=_status(row, latest),
        attempt_count=len({a.attempt_id for a in attempts}),
        latest_attempt_id=None if latest is None else latest.attempt_id,
        worker_id=None if latest is None else latest.worker_id,
        attempt_resources_id=None if latest is None else latest.resources_id,
        started_at=min(started, default=None),
        reward=None if final is None else final.reward,
        error=row.finished_error if row.finished_error is not None else _attempt_error(final),
        updated_at=max(present, default=datetime.fromtimestamp(0, UTC)),
    )


def _attempt_order(attempt: AttemptRow) -> tuple[int, datetime, str]:
    at = attempt.started_at or attempt.finished_at or datetime.fromtimestamp(0, UTC)
    return (attempt.attempt_number, at, attempt.attempt_id)


def _attempt_error(attempt: AttemptRow | None) -> object:
    return None if attempt is None else attempt.error


def _status(row: RolloutRow, latest: AttemptRow | None) -> str:
    if row.finished_status is not None:
        return row.finished_status
    if latest is None or row.queued_attempt > latest.attempt_number:
        return "requeuing" if row.queued_attempt > 1 else "queuing"
    if latest.finished_status is None or latest.finished_status == "succeeded":
        return "running"  # until the runner's RolloutFinished says how it ended
    return "requeuing"


# ---- attempts --------------------------------------------------------------------------------


def apply_attempt(row: AttemptRow | None, event: AttemptStarted | AttemptFinished) -> AttemptRow:
    if row is None:
        row = AttemptRow(
            event.rollout_id, event.attempt_id, event.attempt_number, "running", event.worker_id
        )
    if isinstance(event, AttemptStarted):
        if _first(event, row.started_at, row.started_event_id):
            row = evolve(
                row,
                resources_id=event.resources_id,
                task_offset=event.task_offset,
                started_at=event.occurred_at,
                started_event_id=event.event_id,
                started_worker_id=event.worker_id,
            )
    elif _first(event, row.finished_at, row.finished_event_id):
        row = evolve(
            row,
            finished_at=event.occurred_at,
            finished_status=event.status.value,
            finished_worker_id=event.worker_id,
            error=_error(event.error),
            span_count=event.span_count,
            reward=event.reward,
            finished_event_id=event.event_id,
        )
    return evolve(
        row,
        attempt_number=max(row.attempt_number, event.attempt_number),
        status=row.finished_status or "running",
        worker_id=row.started_worker_id or row.finished_worker_id or row.worker_id,
    )


# ---- spans, resources, workers ---------------------------------------------------------------


def span_row(event: SpanRecorded) -> SpanRow:
    return SpanRow(
        rollout_id=event.rollout_id,
        attempt_id=event.attempt_id,
        sequence=event.sequence,
        event_id=event.event_id,
        recorded_at=event.occurred_at,
        trace_id=event.trace_id,
        span_id=event.span_id,
        parent_span_id=event.parent_span_id,
        name=event.name,
        kind=event.kind.value,
        start_time=from_unix_nano(event.start_time_unix_nano),
        end_time=from_unix_nano(event.end_time_unix_nano),
        start_time_unix_nano=event.start_time_unix_nano,
        end_time_unix_nano=event.end_time_unix_nano,
        status_code=event.status.code.value,
        status_description=event.status.description,
        attributes=event.attributes,
        events=[e.model_dump(mode="json") for e in event.events] if event.events else [],
        links=[link.model_dump(mode="json") for link in event.links] if event.links else [],
        resource=event.resource,
        scope_name=event.scope_name,
    )


def reward_row(event: RewardRecorded) -> RewardRow:
    return RewardRow(
        rollout_id=event.rollout_id,
        event_id=event.event_id,
        attempt_id=event.attempt_id,
        span_id=event.span_id,
        name=event.name,
        value=event.value,
        source=event.source,
        metadata=dict(event.metadata),
        given_at=event.occurred_at,
    )


def from_unix_nano(nanos: int) -> datetime:
    seconds, rest = divmod(nanos, 1_000_000_000)
    return datetime.fromtimestamp(seconds, UTC).replace(microsecond=rest // 1000)


def apply_resources(row: ResourcesRow | None, event: ResourcesPublished) -> ResourcesRow:
    if row is not None and (row.version, row.published_at, row.event_id) >= (
        event.version,
        event.occurred_at,
        event.event_id,
    ):
        return row
    return ResourcesRow(
        resources_id=event.resources_id,
        version=event.version,
        resources={
            name: {"type": type(r).__name__, **r.model_dump(mode="json")}
            for name, r in event.resources.items()
        },
        published_by=event.published_by,
        parent_resources_id=event.parent_resources_id,
        metadata=dict(event.metadata),
        published_at=event.occurred_at,
        event_id=event.event_id,
    )


def apply_heartbeat(row: WorkerRow | None, event: WorkerHeartbeat) -> WorkerRow:
    first_seen = event.occurred_at if row is None else min(row.first_seen_at, event.occurred_at)
    if row is not None and (row.last_heartbeat_at, row.event_id) >= (
        event.occurred_at,
        event.event_id,
    ):
        return evolve(row, first_seen_at=first_seen)
    return WorkerRow(
        worker_id=event.worker_id,
        role=event.role.value,
        status=event.status.value,
        hostname=event.hostname,
        pid=event.pid,
        current_rollouts=list(event.current_rollouts),
        counts=dict(event.counts),
        interval_seconds=event.interval_seconds,
        first_seen_at=first_seen,
        last_heartbeat_at=event.occurred_at,
        event_id=event.event_id,
    )


# ---- the Agent Lightning store facade's records -----------------------------------------------


def agl_key(event: AglRecordRevised) -> AglKey:
    return (event.kind.value, event.rollout_id or "", event.record_id)


def apply_agl_record(row: AglRecordRow | None, event: AglRecordRevised) -> AglRecordRow:
    """The highest revision wins (then the later event, then the higher id)."""
    if row is not None and (row.revision, row.updated_at, row.event_id) >= (
        event.revision,
        event.occurred_at,
        event.event_id,
    ):
        return row
    kind, rollout_id, record_id = agl_key(event)
    return AglRecordRow(
        kind=kind,
        rollout_id=rollout_id,
        record_id=record_id,
        revision=event.revision,
        created_at=event.created_at,
        body=json.loads(event.body_json),
        updated_at=event.occurred_at,
        event_id=event.event_id,
    )
