"""The rollout and attempt lifecycle."""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar

from pydantic import AwareDatetime, Field, field_validator, model_validator

from agl_stream.events.base import (
    MAX_INT,
    MAX_LONG,
    AttemptStatus,
    ErrorInfo,
    Event,
    Record,
    RolloutMode,
    check_json,
    utc_now,
)
from agl_stream.events.ids import Id

TERMINAL_ATTEMPT_STATUSES = frozenset(
    {
        AttemptStatus.SUCCEEDED,
        AttemptStatus.FAILED,
        AttemptStatus.TIMEOUT,
        AttemptStatus.UNRESPONSIVE,
    }
)


class RolloutStatus(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class RolloutQueued(Event):
    key_field: ClassVar[str] = "rollout_id"

    rollout_id: Id
    attempt_number: int = Field(ge=1, le=MAX_INT)
    input_json: str
    mode: RolloutMode
    resources_id: Id | None = None
    timeout_seconds: float | None = Field(default=None, gt=0)
    unresponsive_seconds: float | None = Field(default=None, gt=0)
    max_attempts: int = Field(default=1, ge=1, le=MAX_INT)
    retry_condition: tuple[AttemptStatus, ...] = ()
    metadata: dict[str, str] = Field(default_factory=dict)
    first_queued_at: AwareDatetime = Field(default_factory=utc_now)
    previous_attempt_id: Id | None = None

    @field_validator("input_json")
    @classmethod
    def _input_is_json(cls, value: str) -> str:
        return check_json(value)

    @field_validator("retry_condition")
    @classmethod
    def _only_terminal(cls, value: tuple[AttemptStatus, ...]) -> tuple[AttemptStatus, ...]:
        bad = [s.value for s in value if s not in TERMINAL_ATTEMPT_STATUSES]
        if bad:
            raise ValueError(f"retry_condition may only list terminal attempt statuses, got {bad}")
        return value

    @model_validator(mode="after")
    def _attempts_in_range(self) -> RolloutQueued:
        if self.attempt_number > self.max_attempts:
            raise ValueError(
                f"attempt_number {self.attempt_number} exceeds max_attempts {self.max_attempts}"
            )
        return self


class RolloutCancelled(Event):
    key_field: ClassVar[str] = "rollout_id"

    rollout_id: Id
    reason: str | None = None
    requested_by: str | None = None


class AttemptTask(Record):
    """The task of an attempt nobody queued (a gateway session, an ingested trace)."""

    input_json: str
    mode: RolloutMode
    metadata: dict[str, str] = Field(default_factory=dict)

    @field_validator("input_json")
    @classmethod
    def _input_is_json(cls, value: str) -> str:
        return check_json(value)


class AttemptStarted(Event):
    key_field: ClassVar[str] = "rollout_id"

    rollout_id: Id
    attempt_id: Id
    attempt_number: int = Field(ge=1, le=MAX_INT)
    worker_id: Id
    resources_id: Id | None = None
    task_offset: int | None = Field(default=None, ge=0, le=MAX_LONG)
    task: AttemptTask | None = None  # only on attempts no RolloutQueued asked for


class AttemptFinished(Event):
    key_field: ClassVar[str] = "rollout_id"

    rollout_id: Id
    attempt_id: Id
    attempt_number: int = Field(ge=1, le=MAX_INT)
    worker_id: Id
    status: AttemptStatus
    error: ErrorInfo | None = None
    span_count: int = Field(ge=0, le=MAX_LONG)
    reward: float | None = None

    @field_validator("status")
    @classmethod
    def _terminal(cls, value: AttemptStatus) -> AttemptStatus:
        if value not in TERMINAL_ATTEMPT_STATUSES:
            raise ValueError(f"an attempt cannot finish as {value.value!r}")
        return value


class RolloutFinished(Event):
    key_field: ClassVar[str] = "rollout_id"

    rollout_id: Id
    status: RolloutStatus
    attempt_id: Id | None = None
    attempt_count: int = Field(ge=0, le=MAX_INT)
    error: ErrorInfo | None = None


__all__ = [
    "TERMINAL_ATTEMPT_STATUSES",
    "AttemptFinished",
    "AttemptStarted",
    "AttemptTask",
    "RolloutCancelled",
    "RolloutFinished",
    "RolloutQueued",
    "RolloutStatus",
]
