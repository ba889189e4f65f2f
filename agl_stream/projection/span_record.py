"""A SpanRecorded record, as Avro read it, straight to its spans row (no event model).

Spans are most of what the projector reads, and building a SpanRecorded model first cost
more than reading the Avro body. `span_row_from_datum` takes the plain datum (logical types
left as their Avro values: the event id as text, occurred_at as microseconds) and checks
what the model checks beyond the Avro types; a record it refuses raises ValueError, and the
stream dead-letters it as invalid, exactly as a record the model refuses. A test holds it
equal to `fold.span_row(SpanRecorded)` on random spans.

`span_tuple_from_record` is the fast path before it: a compiled reader of the current span
schema (_spanfast.c) that writes the row from the record's bytes as PostgreSQL's binary COPY
takes it, checks what the model checks, and steps aside (None) for anything the general path
must judge; tests hold the two equal.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from agl_stream.bus.codec import HEADER_LENGTH, MARKER
from agl_stream.bus.schema_registry import default_registry
from agl_stream.events.ids import require_id
from agl_stream.projection.rows import SpanRow

try:
    from agl_stream.projection import _spanfast  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler: the general path reads every span
    _spanfast = None

# The compiled reader reads this schema alone (a test holds it to schemas/SpanRecorded.avsc).
_FINGERPRINT = default_registry().current["SpanRecorded"].fingerprint

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
_TRACE_ID = re.compile(r"[0-9a-f]{32}")
_SPAN_ID = re.compile(r"[0-9a-f]{16}")
_CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def span_row_from_datum(datum: Mapping[str, Any]) -> SpanRow:
    """The spans row of one plain SpanRecorded datum; ValueError names what is wrong."""
    rollout_id = require_id("rollout_id", datum["rollout_id"])
    attempt_id = require_id("attempt_id", datum["attempt_id"])
    sequence, start, end = (
        datum["sequence"],
        datum["start_time_unix_nano"],
        datum["end_time_unix_nano"],
    )
    if sequence < 0 or start < 0 or end < 0:
        raise ValueError("sequence, start_time_unix_nano and end_time_unix_nano must be >= 0")
    trace_id, span_id, parent = datum["trace_id"], datum["span_id"], datum["parent_span_id"]
    _check_ids(trace_id, span_id)
    if parent is not None and not _SPAN_ID.fullmatch(parent):
        raise ValueError("parent_span_id must be 16 lowercase hex digits")
    status = datum["status"]
    events: Sequence[Mapping[str, Any]] = datum["events"]
    links: Sequence[Mapping[str, Any]] = datum["links"]
    for event in events:
        if event["time_unix_nano"] < 0:
            raise ValueError("a span event's time_unix_nano must be >= 0")
    for link in links:
        _check_ids(link["trace_id"], link["span_id"])
    return tuple.__new__(
        SpanRow,
        (
            rollout_id,
            attempt_id,
            sequence,
            _event_id(datum["event_id"]),
            _micros(datum["occurred_at"]),
            trace_id,
            span_id,
            parent,
            datum["name"],
            datum["kind"],
            _micros(start // 1000),
            _micros(end // 1000),
            start,
            end,
            status["code"],
            status["description"],
            datum["attributes"],
            events,
            links,
            datum["resource"],
            datum["scope_name"],
        ),
    )


def span_tuple_from_record(data: bytes) -> bytes | None:
    """The spans row of a SpanRecorded record (single-object encoded) as a binary COPY tuple
    (copy_binary.COLUMNS' order), written by the compiled reader; None where that reader is
    not built, the record was written with another schema, or anything in it is for
    span_row_from_datum to judge (it words every refusal)."""
    if (
        _spanfast is None
        or not data.startswith(MARKER)
        or data[len(MARKER) : HEADER_LENGTH] != _FINGERPRINT
    ):
        return None
    encoded: bytes | None = _spanfast.decode(data, HEADER_LENGTH)
    return encoded


def _check_ids(trace_id: str, span_id: str) -> None:
    if not _TRACE_ID.fullmatch(trace_id):
        raise ValueError("trace_id must be 32 lowercase hex digits")
    if not _SPAN_ID.fullmatch(span_id):
        raise ValueError("span_id must be 16 lowercase hex digits")


def _event_id(text: str) -> str:
    """The canonical text of a UUID (PostgreSQL reads it as such)."""
    if _CANONICAL_UUID.fullmatch(text):
        return text
    try:
        return str(uuid.UUID(text))  # other spellings the model accepts too
    except ValueError:
        raise ValueError(f"event_id {text[:40]!r} is not a UUID") from None


def _micros(micros: int) -> datetime:
    try:
        return _EPOCH + micros * _MICROSECOND
    except OverflowError:
        raise ValueError(f"time {micros} us since the epoch is out of range") from None
