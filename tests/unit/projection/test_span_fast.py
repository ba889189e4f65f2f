"""The compiled span reader (agl_stream/projection/_spanfast.c) gives the projector the binary
COPY tuples the general path gives (fastavro, span_row_from_datum, copy_binary.span_tuple),
JSON columns as the same JSON, or steps aside for the general path: on random spans, and on
records damaged at random (a row it makes from a damaged record must be the row the general
path makes from it; it never takes a record the general path refuses)."""

from __future__ import annotations

import io
import math
import shutil
import struct
from typing import Any

import fastavro
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_stream.bus.codec import HEADER_LENGTH, MARKER, Codec, DecodeError
from agl_stream.bus.schema_registry import default_registry
from agl_stream.events import SpanRecorded
from agl_stream.projection import span_record
from agl_stream.projection.copy_binary import COLUMNS, span_tuple
from agl_stream.projection.rows import SpanRow
from agl_stream.projection.span_record import span_row_from_datum, span_tuple_from_record
from tests.support.golden import GOLDEN_EVENTS
from tests.support.strategies import EVENT_STRATEGIES
from tests.unit.projection.test_span_record import plain, raw_span

codec = Codec()
built = span_record._spanfast is not None
needs_reader = pytest.mark.skipif(not built, reason="the compiled span reader is not built")
JSON_COLUMNS = {"attributes", "events", "links", "resource"}


def general(data: bytes) -> SpanRow | None:
    """The general path's row (fastavro, then span_row_from_datum); None: it refuses."""
    try:
        return span_row_from_datum(plain(data))
    except (DecodeError, ValueError):
        return None


def fields(encoded: bytes) -> dict[str, Any]:
    """A binary COPY tuple's fields by column (bytes, None for NULL), JSON columns parsed."""
    assert struct.unpack_from("!h", encoded)[0] == len(COLUMNS)
    out: dict[str, Any] = {}
    at = 2
    for column in COLUMNS:
        (size,) = struct.unpack_from("!i", encoded, at)
        at += 4
        value = None if size == -1 else encoded[at : at + size]
        at += max(size, 0)
        if column in JSON_COLUMNS:
            assert value is not None and value[:1] == b"\x01", "binary jsonb: version byte 1"
            value = orjson.loads(value[1:])
        out[column] = value
    assert at == len(encoded), "nothing after the last field"
    return out


def unfit(value: Any) -> bool:
    """What the reader leaves to the general path: a double JSON cannot hold, a NUL in text
    (PostgreSQL's text and jsonb hold none); and ids beyond printable ASCII (the general path
    applies the whole id rule to them)."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(unfit(k) or unfit(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(unfit(v) for v in value)
    return False


def test_the_reader_is_built_where_a_c_compiler_is() -> None:
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here: the projector reads spans through fastavro")
    assert built, "agl_stream/projection/_spanfast.c was not built: run `make install` again"


@needs_reader
@settings(max_examples=300, deadline=None)
@given(EVENT_STRATEGIES["SpanRecorded"])
def test_rows_equal_the_general_paths(event: SpanRecorded) -> None:
    data = codec.encode(event)
    slow = general(data)
    assert slow is not None
    fast = span_tuple_from_record(data)
    if fast is None:
        ids = (slow.rollout_id, slow.attempt_id)
        assert unfit(tuple(slow)) or not all(i.isascii() for i in ids)
    else:
        assert fields(fast) == fields(span_tuple(slow))


@needs_reader
def test_the_reader_reads_the_current_span_schema() -> None:
    """Fails when schemas/SpanRecorded.avsc changes and _spanfast.c does not follow it."""
    golden = GOLDEN_EVENTS["SpanRecorded"]
    assert golden.attributes and golden.events and golden.links, "the golden span has them all"
    data = codec.encode(golden)
    fast = span_tuple_from_record(data)
    slow = general(data)
    assert fast is not None and slow is not None
    assert fields(fast) == fields(span_tuple(slow))


@needs_reader
def test_records_of_another_schema_are_left_to_the_general_path() -> None:
    data = codec.encode(GOLDEN_EVENTS["SpanRecorded"])
    other = default_registry().current["RolloutQueued"].fingerprint
    assert span_tuple_from_record(MARKER + other + data[HEADER_LENGTH:]) is None


Damage = tuple[str, int, int]


@needs_reader
@settings(max_examples=1500, deadline=None)
@given(
    EVENT_STRATEGIES["SpanRecorded"],
    st.lists(
        st.tuples(
            st.sampled_from(["set", "insert", "delete", "truncate"]),
            st.integers(min_value=0, max_value=10_000),
            st.integers(min_value=0, max_value=255),
        ),
        min_size=1,
        max_size=3,
    ),
)
def test_a_damaged_record_reads_as_the_general_path_reads_it(
    event: SpanRecorded, damage: list[Damage]
) -> None:
    record = bytearray(codec.encode(event))
    for how, at, byte in damage:
        body = len(record) - HEADER_LENGTH
        where = HEADER_LENGTH + (at % body if body else 0)
        if how == "set" and body:
            record[where] = byte
        elif how == "insert":
            record.insert(where, byte)
        elif how == "delete" and body:
            del record[where]
        elif how == "truncate":
            del record[where:]
    data = bytes(record)
    fast = span_tuple_from_record(data)
    if fast is not None:
        slow = general(data)
        assert slow is not None, "the reader took a record the general path refuses"
        assert fields(fast) == fields(span_tuple(slow))


@needs_reader
@pytest.mark.parametrize(
    ("text", "taken"),
    [
        ("plain", True),
        ('quote " and backslash \\', True),
        ("tab\tnewline\ncontrol\x01", True),
        ("ünïcödé ✓ 😀", True),
        ("nul \x00 inside", False),  # PostgreSQL's jsonb takes no \u0000
    ],
)
def test_attribute_text_is_escaped_as_json(text: str, taken: bool) -> None:
    event = GOLDEN_EVENTS["SpanRecorded"].model_copy(
        update={"attributes": {text: text, "list": [text, 1.5, -(2**63), True, None]}}
    )
    data = codec.encode(event)
    fast = span_tuple_from_record(data)
    slow = general(data)
    assert slow is not None
    assert (fast is not None) == taken
    if fast is not None:
        assert fields(fast) == fields(span_tuple(slow))


@needs_reader
@pytest.mark.parametrize(
    "changes",
    [
        {"rollout_id": ""},
        {"attempt_id": ""},
        {"sequence": -1},
        {"start_time_unix_nano": -5},
        {"end_time_unix_nano": -5},
        {"trace_id": "ABCDEF" * 6},
        {"trace_id": "0" * 31},
        {"span_id": "123"},
        {"parent_span_id": "zz" * 8},
        {"events": [{"name": "e", "time_unix_nano": -1, "attributes": {}}]},
        {"links": [{"trace_id": "0" * 32, "span_id": "x", "attributes": {}}]},
        {"links": [{"trace_id": "0" * 30, "span_id": "0" * 16, "attributes": {}}]},
        {"event_id": "not a uuid"},
        {"event_id": "12345678-1234-5678-1234-56781234567G"},
        {"occurred_at": 2**62},
    ],
    ids=lambda changes: ",".join(changes),
)
def test_what_the_model_refuses_is_left_to_the_general_path(changes: dict[str, Any]) -> None:
    data = raw_span(**changes)
    assert general(data) is None
    assert span_tuple_from_record(data) is None


@needs_reader
def test_other_event_id_spellings_are_left_to_the_general_path() -> None:
    schema = default_registry().current["SpanRecorded"]
    datum = codec.decode_datum(codec.encode(GOLDEN_EVENTS["SpanRecorded"]), plain=True)[1]
    canonical = "abcdef01-2345-6789-abcd-ef0123456789"
    for spelling in (canonical.upper(), canonical.replace("-", ""), "{" + canonical + "}"):
        body = io.BytesIO()  # the plain schema writes the text as it is
        fastavro.schemaless_writer(body, schema.plain, datum | {"event_id": spelling})
        data = MARKER + schema.fingerprint + body.getvalue()
        assert span_tuple_from_record(data) is None
        row = general(data)
        assert row is not None and row.event_id == canonical


@needs_reader
@pytest.mark.parametrize(
    "micros",
    [
        -62_135_596_800_000_000,  # 0001-01-01T00:00:00
        -62_135_596_800_000_001,  # a microsecond before: out of range
        -1,
        0,
        1_795_240_800_123_456,
        253_402_300_799_999_999,  # 9999-12-31T23:59:59.999999
        253_402_300_800_000_000,  # out of range
        -(2**63),
        2**63 - 1,
    ],
)
def test_times_read_as_the_general_path_reads_them(micros: int) -> None:
    data = raw_span(occurred_at=micros)
    fast, slow = span_tuple_from_record(data), general(data)
    assert (fast is None) == (slow is None)
    if fast is not None and slow is not None:
        assert fields(fast) == fields(span_tuple(slow))
