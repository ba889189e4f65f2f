"""What every event shares: identity, time, immutability."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import ClassVar

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator

# Avro's int and long: a model field of either type is bounded by its range, so that every
# event the model takes can be encoded.
MAX_INT = 2**31 - 1
MAX_LONG = 2**63 - 1


def utc_now() -> datetime:
    # Avro timestamp-micros keeps microseconds; trimming here makes a decoded event equal
    # the one that was encoded.
    return datetime.now(UTC)


class Record(BaseModel):
    """An immutable value inside an event."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)


class Event(Record):
    """An immutable, past-tense fact. Subclasses mirror one Avro schema under schemas/."""

    schema_version: ClassVar[int] = 1
    # The key that partitions the event on its topic: a field name.
    key_field: ClassVar[str]

    event_id: uuid.UUID = Field(default_factory=uuid.uuid4)
    occurred_at: AwareDatetime = Field(default_factory=utc_now)

    @field_validator("occurred_at")
    @classmethod
    def _to_utc(cls, value: datetime) -> datetime:
        return value.astimezone(UTC)

    @property
    def key(self) -> str:
        """The record key on the topic (rollout id, resources id, worker id)."""
        return str(getattr(self, self.key_field))

    @classmethod
    def type_name(cls) -> str:
        return cls.__name__


class ErrorInfo(Record):
    type: str
    message: str
    traceback: str | None = None


class AttemptStatus(StrEnum):
    PREPARING = "preparing"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMEOUT = "timeout"
    UNRESPONSIVE = "unresponsive"


class RolloutMode(StrEnum):
    TRAIN = "train"
    VAL = "val"
    TEST = "test"


def check_json(value: str) -> str:
    """Reject a string that is not JSON: a semantic error the codec dead-letters."""
    try:
        json.loads(value)
    except ValueError as exc:
        raise ValueError(f"not valid JSON: {exc}") from exc
    return value
