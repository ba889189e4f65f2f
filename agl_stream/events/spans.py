"""Spans: the trace of what an agent did, in OpenTelemetry's shape."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, ClassVar

from pydantic import AfterValidator, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from agl_stream.events.base import MAX_LONG, Event, Record
from agl_stream.events.ids import Id

# Strict types keep True a boolean and 1 a long through a round trip.
Scalar = StrictBool | StrictInt | StrictFloat | StrictStr | None
AttributeValue = Scalar | list[Scalar]
Attributes = dict[str, AttributeValue]

_TRACE_ID = re.compile(r"^[0-9a-f]{32}$")
_SPAN_ID = re.compile(r"^[0-9a-f]{16}$")


def _trace_id(value: str) -> str:
    if not _TRACE_ID.match(value):
        raise ValueError("trace_id must be 32 lowercase hex digits")
    return value


def _span_id(value: str) -> str:
    if not _SPAN_ID.match(value):
        raise ValueError("span_id must be 16 lowercase hex digits")
    return value


TraceId = Annotated[str, AfterValidator(_trace_id)]
SpanId = Annotated[str, AfterValidator(_span_id)]


class SpanKind(StrEnum):
    INTERNAL = "INTERNAL"
    SERVER = "SERVER"
    CLIENT = "CLIENT"
    PRODUCER = "PRODUCER"
    CONSUMER = "CONSUMER"


class StatusCode(StrEnum):
    UNSET = "UNSET"
    OK = "OK"
    ERROR = "ERROR"


class SpanStatus(Record):
    code: StatusCode = StatusCode.UNSET
    description: str | None = None


class SpanEvent(Record):
    name: str
    time_unix_nano: int = Field(ge=0, le=MAX_LONG)
    attributes: Attributes = Field(default_factory=dict)


class SpanLink(Record):
    trace_id: TraceId
    span_id: SpanId
    attributes: Attributes = Field(default_factory=dict)


class SpanRecorded(Event):
    key_field: ClassVar[str] = "rollout_id"

    rollout_id: Id
    attempt_id: Id
    sequence: int = Field(ge=0, le=MAX_LONG)
    trace_id: TraceId
    span_id: SpanId
    parent_span_id: SpanId | None = None
    name: str
    kind: SpanKind = SpanKind.INTERNAL
    start_time_unix_nano: int = Field(ge=0, le=MAX_LONG)
    end_time_unix_nano: int = Field(ge=0, le=MAX_LONG)
    status: SpanStatus = Field(default_factory=SpanStatus)
    attributes: Attributes = Field(default_factory=dict)
    events: tuple[SpanEvent, ...] = ()
    links: tuple[SpanLink, ...] = ()
    resource: Attributes = Field(default_factory=dict)
    scope_name: str | None = None


TOO_LARGE_ATTRIBUTE = "agl.span.too_large"


def too_large_stand_in(span: SpanRecorded, size: int, limit: int) -> SpanRecorded:
    """What goes on the topic for a span too large to be a record: the same identity,
    place and times, its attributes, events and links replaced by the reason (so the
    attempt's span count stays exact and the loss is visible where the span would be)."""
    reason = f"this span was {size:,} bytes encoded, over the record limit of {limit:,}"
    return span.model_copy(
        update={
            "attributes": {TOO_LARGE_ATTRIBUTE: reason},
            "events": (),
            "links": (),
            "resource": {},
        }
    )
