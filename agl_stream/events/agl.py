"""The Agent Lightning store facade's records (agl_stream.compat.agl): its rollouts, attempts,
workers and resources snapshots in Agent Lightning 0.3's own JSON shape."""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import ClassVar

from pydantic import AwareDatetime, Field, field_validator

from agl_stream.events.base import MAX_LONG, Event, check_json
from agl_stream.events.ids import Id


class AglRecordKind(StrEnum):
    ROLLOUT = "rollout"
    ATTEMPT = "attempt"
    WORKER = "worker"
    RESOURCES = "resources"


class AglRecordRevised(Event):
    """A record of the facade as it now is; the highest revision of a record wins."""

    key_field: ClassVar[str] = "partition_key"

    kind: AglRecordKind
    partition_key: Id
    record_id: Id
    rollout_id: Id | None = None
    revision: int = Field(ge=1, le=MAX_LONG)
    created_at: AwareDatetime
    body_json: str

    @field_validator("created_at")
    @classmethod
    def _created_in_utc(cls, value: datetime) -> datetime:
        return value.astimezone(UTC)

    @field_validator("body_json")
    @classmethod
    def _body_is_json(cls, value: str) -> str:
        return check_json(value)


__all__ = ["AglRecordKind", "AglRecordRevised"]
