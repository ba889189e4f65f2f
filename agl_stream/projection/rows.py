"""Rows of the read model, one class per table; field names are column names.

A row keeps, for each kind of event that shapes it, the facts of one chosen event (its
"slot"): the earliest by (occurred_at, event_id), or for queued tasks the highest attempt.
Choosing by a total order makes the fold commutative and idempotent: any interleaving of
the topics, and any duplicate, gives the same row.
"""

from __future__ import annotations

import operator
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, NamedTuple, TypeVar

Json = Any  # a value PostgreSQL stores as jsonb


@dataclass(frozen=True, slots=True)
class RolloutRow:
    rollout_id: str
    status: str
    mode: str | None = None
    input: Json = None
    resources_id: str | None = None
    metadata: Json = field(default_factory=dict)
    timeout_seconds: float | None = None
    unresponsive_seconds: float | None = None
    max_attempts: int | None = None
    retry_condition: list[str] | None = None
    first_queued_at: datetime | None = None
    queued_attempt: int = 0
    queued_at: datetime | None = None
    queued_event_id: uuid.UUID | None = None
    cancel_requested_at: datetime | None = None
    cancel_reason: str | None = None
    cancel_requested_by: str | None = None
    cancel_event_id: uuid.UUID | None = None
    finished_status: str | None = None
    finished_at: datetime | None = None
    finished_attempt_id: str | None = None
    finished_attempt_count: int | None = None
    finished_error: Json = None
    finished_event_id: uuid.UUID | None = None
    attempt_count: int = 0
    latest_attempt_id: str | None = None
    worker_id: str | None = None
    attempt_resources_id: str | None = None
    started_at: datetime | None = None
    reward: float | None = None
    error: Json = None
    updated_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class AttemptRow:
    rollout_id: str
    attempt_id: str
    attempt_number: int
    status: str
    worker_id: str
    resources_id: str | None = None
    task_offset: int | None = None
    started_at: datetime | None = None
    started_event_id: uuid.UUID | None = None
    started_worker_id: str | None = None
    finished_at: datetime | None = None
    finished_status: str | None = None
    finished_worker_id: str | None = None
    error: Json = None
    span_count: int | None = None
    reward: float | None = None
    finished_event_id: uuid.UUID | None = None


class SpanRow(NamedTuple):
    """A tuple, so that a batch of them is COPY's input as it is (no per-row conversion)."""

    rollout_id: str
    attempt_id: str
    sequence: int
    event_id: uuid.UUID
    recorded_at: datetime
    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    kind: str
    start_time: datetime
    end_time: datetime
    start_time_unix_nano: int
    end_time_unix_nano: int
    status_code: str
    status_description: str | None
    attributes: Json
    events: Json
    links: Json
    resource: Json
    scope_name: str | None


@dataclass(frozen=True, slots=True)
class RewardRow:
    rollout_id: str
    event_id: uuid.UUID
    attempt_id: str | None
    span_id: str | None
    name: str
    value: float
    source: str | None
    metadata: Json
    given_at: datetime


@dataclass(frozen=True, slots=True)
class ResourcesRow:
    resources_id: str
    version: int
    resources: Json
    published_by: str | None
    parent_resources_id: str | None
    metadata: Json
    published_at: datetime
    event_id: uuid.UUID


@dataclass(frozen=True, slots=True)
class WorkerRow:
    worker_id: str
    role: str
    status: str
    hostname: str
    pid: int
    current_rollouts: list[str]
    counts: Json
    interval_seconds: float
    first_seen_at: datetime
    last_heartbeat_at: datetime
    event_id: uuid.UUID


@dataclass(frozen=True, slots=True)
class AglRecordRow:
    """A record of the Agent Lightning store facade (agl_stream.compat.agl): its highest revision.
    `rollout_id` is the rollout of a rollout or attempt record, '' for the others."""

    kind: str
    rollout_id: str
    record_id: str
    revision: int
    created_at: datetime
    body: Json
    updated_at: datetime
    event_id: uuid.UUID


Row = RolloutRow | AttemptRow | SpanRow | ResourcesRow | WorkerRow | RewardRow | AglRecordRow


_COLUMNS: dict[type[Row], tuple[str, ...]] = {
    SpanRow: SpanRow._fields,
    **{
        t: tuple(f.name for f in fields(t))
        for t in (RolloutRow, AttemptRow, ResourcesRow, WorkerRow, RewardRow, AglRecordRow)
    },
}
_GETTERS: dict[type[Row], Callable[[Row], tuple[Any, ...]]] = {
    t: operator.attrgetter(*names) for t, names in _COLUMNS.items()
}


R = TypeVar("R", RolloutRow, AttemptRow, ResourcesRow, WorkerRow)
_set = object.__setattr__


def evolve(row: R, **changes: Any) -> R:
    """dataclasses.replace for these rows, at a third of its cost (the fold calls it for
    every lifecycle event): the new row's slots are set directly, unchanged ones copied.
    Field names are checked as replace would."""
    cls = type(row)
    unknown = changes.keys() - _COLUMNS[cls]
    if unknown:
        raise TypeError(f"{cls.__name__} has no fields {sorted(unknown)}")
    new = object.__new__(cls)
    for name in _COLUMNS[cls]:
        _set(new, name, changes[name] if name in changes else getattr(row, name))
    return new


def columns(row_type: type[Row]) -> tuple[str, ...]:
    return _COLUMNS[row_type]


def values(row: Row) -> tuple[Any, ...]:
    """The row's values in column order."""
    if type(row) is SpanRow:
        return row
    return _GETTERS[type(row)](row)
