"""Query parameters: validated here, before any SQL, so a bad filter is a sentence, not a
stack trace. Pure code."""

from __future__ import annotations

import base64
import binascii
import json
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

ROLLOUT_STATUSES = (
    "queuing", "requeuing", "running", "succeeded", "failed", "cancelled",
)  # fmt: skip
MODES = ("train", "val", "test")
SORTS = ("queued", "updated", "id")
MAX_LIMIT = 1000


class QueryError(ValueError):
    """A query the read model cannot answer as asked; the message says why."""


class NotFound(QueryError, LookupError):
    """No such rollout (or resources, or worker) in the read model."""


class RolloutFilter(BaseModel):
    """Which rollouts, in which order, how many."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    status: tuple[Literal[ROLLOUT_STATUSES], ...] = ()  # type: ignore[valid-type]
    mode: tuple[Literal[MODES], ...] = ()  # type: ignore[valid-type]
    since: datetime | None = None
    until: datetime | None = None
    time_field: Literal["queued", "updated", "finished"] = "updated"
    worker_id: str | None = None
    resources_id: str | None = Field(
        default=None, description="the pin, or the resources the latest attempt ran with"
    )
    metadata: dict[str, str | None] = Field(
        default_factory=dict, description="key=value must match; key=None: the key is present"
    )
    sort: Literal[SORTS] = "queued"  # type: ignore[valid-type]
    descending: bool = False
    limit: int = Field(default=50, ge=1, le=MAX_LIMIT)
    cursor: str | None = None

    @field_validator("worker_id", "resources_id")
    @classmethod
    def _text(cls, value: str | None) -> str | None:
        if _has_nul(value):
            raise ValueError(NUL)
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_text(cls, value: dict[str, str | None]) -> dict[str, str | None]:
        if any(_has_nul(k, v) for k, v in value.items()):
            raise ValueError(NUL)
        return value

    @field_validator("since", "until")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value

    @classmethod
    def of(cls, **options: Any) -> RolloutFilter:
        """Build from keyword options; a QueryError names each bad one."""
        try:
            made = cls.model_validate(options)
        except ValidationError as exc:
            raise QueryError(explain(exc)) from None
        if made.since and made.until and made.since > made.until:
            raise QueryError("since must not be after until")
        if made.cursor is not None:
            decode_cursor(made.cursor, made.sort, made.descending)
        return made


def explain(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"] if not isinstance(p, int)) or "query"
        if error["type"] == "extra_forbidden":
            parts.append(f"unknown field {where!r}")
        elif error["type"] == "literal_error":
            allowed = error["ctx"]["expected"]
            parts.append(f"{where}: {error['input']!r} is not one of {allowed}")
        else:
            parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)


def encode_cursor(sort: str, descending: bool, value: Any, rollout_id: str) -> str:
    if isinstance(value, datetime):
        value = value.isoformat()
    raw = json.dumps([sort, descending, value, rollout_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, sort: str, descending: bool) -> tuple[Any, str]:
    """(sort value, rollout id) of the last row of the previous page."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        c_sort, c_desc, value, rollout_id = json.loads(raw)
    except (binascii.Error, ValueError, TypeError):
        raise QueryError(
            "cursor is not one this API returned (pass a page's next_cursor as it is)"
        ) from None
    if (c_sort, c_desc) != (sort, descending):
        raise QueryError(
            f"cursor belongs to sort={c_sort!r} descending={c_desc}; ask with the same sort"
        )
    if sort != "id":
        try:
            value = datetime.fromisoformat(value)
        except (TypeError, ValueError):
            raise QueryError("cursor is damaged: its position is not a time") from None
    return value, str(rollout_id)


NUL = "contains a NUL character (\\x00), which no stored text has"


def _has_nul(*values: str | None) -> bool:
    return any(v is not None and "\x00" in v for v in values)


def check_text(**values: str | None) -> None:
    """PostgreSQL text cannot hold NUL: a value with one matches nothing and is refused."""
    for name, value in values.items():
        if _has_nul(value):
            raise QueryError(f"{name} {NUL}")


def check_limit(limit: int, most: int = MAX_LIMIT) -> int:
    if not 1 <= limit <= most:
        raise QueryError(f"limit must be between 1 and {most}, got {limit}")
    return limit


def check_range(
    since: datetime | None, until: datetime | None
) -> tuple[datetime | None, datetime | None]:
    """The range with times given without a zone read as UTC (as in RolloutFilter)."""
    since, until = (
        t.replace(tzinfo=UTC) if t is not None and t.tzinfo is None else t for t in (since, until)
    )
    if since is not None and until is not None and since > until:
        raise QueryError("since must not be after until")
    return since, until
