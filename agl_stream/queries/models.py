"""What queries return: frozen pydantic models (JSON via model_dump(mode="json"))."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

T = TypeVar("T")


class Result(BaseModel):
    model_config = ConfigDict(frozen=True)


class Rollout(Result):
    rollout_id: str
    status: str
    mode: str | None
    input: Any
    resources_id: str | None  # the pin
    metadata: dict[str, str]
    timeout_seconds: float | None
    unresponsive_seconds: float | None
    max_attempts: int | None
    retry_condition: list[str] | None
    first_queued_at: datetime | None
    attempt_count: int
    latest_attempt_id: str | None
    worker_id: str | None
    attempt_resources_id: str | None
    started_at: datetime | None
    finished_at: datetime | None
    reward: float | None
    error: dict[str, Any] | None
    cancel_requested_at: datetime | None
    cancel_reason: str | None
    updated_at: datetime


class Attempt(Result):
    rollout_id: str
    attempt_id: str
    attempt_number: int
    status: str
    worker_id: str
    resources_id: str | None
    started_at: datetime | None
    finished_at: datetime | None
    error: dict[str, Any] | None
    span_count: int | None  # how many spans the attempt says it emitted (when finished)
    spans_received: int  # how many the read model holds
    reward: float | None

    @property
    def complete(self) -> bool:
        """Finished, and every span it emitted is here."""
        return self.span_count is not None and self.spans_received >= self.span_count


class Span(Result):
    rollout_id: str
    attempt_id: str
    sequence: int
    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_span_id: str | None
    start_time: datetime
    end_time: datetime
    status_code: str
    status_description: str | None
    attributes: dict[str, Any]
    events: list[Any]
    links: list[Any]
    resource: dict[str, Any]
    scope_name: str | None


class Reward(Result):
    """A reward given from outside an attempt (RewardRecorded) that counted."""

    rollout_id: str
    attempt_id: str | None  # None: the rollout as a whole
    span_id: str | None  # the LLM call it is for, if any
    name: str
    value: float
    source: str | None
    metadata: dict[str, str]
    given_at: datetime
    event_id: str


class Resources(Result):
    resources_id: str
    version: int
    resources: dict[str, Any]
    published_by: str | None
    parent_resources_id: str | None
    metadata: dict[str, str]
    published_at: datetime


class Worker(Result):
    worker_id: str
    role: str
    status: str
    health: str  # alive | stale (no heartbeat for 3 intervals) | stopped
    hostname: str
    pid: int
    current_rollouts: list[str]
    counts: dict[str, int]
    interval_seconds: float
    first_seen_at: datetime
    last_heartbeat_at: datetime


class PartitionLag(Result):
    topic: str
    partition: int
    next_offset: int
    end_offset: int
    lag: int
    updated_at: datetime | None


class Page(Result, Generic[T]):
    items: list[T]
    next_cursor: str | None  # pass back as `cursor` for the next page; None on the last
