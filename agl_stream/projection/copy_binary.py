"""Spans rows in PostgreSQL's binary COPY format (https://www.postgresql.org/docs/current/
sql-copy.html#id-1.9.3.55.9.4), the form the projector sends them in.

The compiled span reader (_spanfast.c) writes a span's tuple straight from its Avro body;
`span_tuple` writes one for a SpanRow built in Python (records the reader leaves to the
general path), in the same column order, so one COPY takes both; NULs become U+FFFD as
pg_text says (the reader leaves text with a NUL to the general path). Pure code.
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from agl_stream.projection import pg_text
from agl_stream.projection.rows import SpanRow, columns

# The order the compiled reader writes (the Avro schema's): SpanRow's columns with event_id
# and recorded_at first.
_FIRST = ("event_id", "recorded_at")
COLUMNS: tuple[str, ...] = (*_FIRST, *(c for c in columns(SpanRow) if c not in _FIRST))

HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack("!ii", 0, 0)  # no flags, no extension
TRAILER = struct.pack("!h", -1)
_COUNT = struct.pack("!h", len(COLUMNS))
_NULL = struct.pack("!i", -1)
_INT8 = struct.Struct("!iq")
_LENGTH = struct.Struct("!i")
_PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)


def _text(value: str) -> bytes:
    data = pg_text.text(value).encode()
    return _LENGTH.pack(len(data)) + data


def _int8(value: int) -> bytes:
    return _INT8.pack(8, value)


def _uuid(value: object) -> bytes:
    return _LENGTH.pack(16) + uuid.UUID(str(value)).bytes


def _timestamptz(value: datetime) -> bytes:
    delta = value - _PG_EPOCH
    return _int8((delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds)


def _jsonb(value: object) -> bytes:
    data = value if isinstance(value, bytes) else pg_text.jsonb(value)
    return _LENGTH.pack(len(data)) + data


_ENCODERS: dict[str, Callable[[Any], bytes]] = {
    "event_id": _uuid,
    "recorded_at": _timestamptz,
    "sequence": _int8,
    "start_time": _timestamptz,
    "end_time": _timestamptz,
    "start_time_unix_nano": _int8,
    "end_time_unix_nano": _int8,
    "attributes": _jsonb,
    "events": _jsonb,
    "links": _jsonb,
    "resource": _jsonb,
}
_COLUMN_ENCODERS = tuple((SpanRow._fields.index(c), _ENCODERS.get(c, _text)) for c in COLUMNS)


def span_tuple(row: SpanRow) -> bytes:
    """One row as a binary COPY tuple, columns in COLUMNS' order."""
    parts = [_COUNT]
    for index, encode in _COLUMN_ENCODERS:
        value = row[index]
        parts.append(_NULL if value is None else encode(value))
    return b"".join(parts)


def copy_data(spans: Iterable[SpanRow | bytes]) -> bytes:
    """A whole binary COPY input: rows already encoded (bytes) as they are, SpanRows encoded."""
    encoded = (span if isinstance(span, bytes) else span_tuple(span) for span in spans)
    return b"".join((HEADER, *encoded, TRAILER))
