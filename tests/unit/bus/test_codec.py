"""The wire format: golden bytes, round trips on random events, and clear decode errors."""

from __future__ import annotations

import contextlib
import io
import json

import fastavro
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_stream.bus.codec import MARKER, Codec, DecodeError
from agl_stream.bus.schema_registry import default_registry
from agl_stream.events import EVENT_TYPES, Event
from tests.support import SUPPORT
from tests.support.golden import GOLDEN_EVENTS
from tests.support.strategies import EVENT_STRATEGIES

GOLDEN_BYTES = json.loads((SUPPORT / "golden_bytes.json").read_text())
codec = Codec()


def test_fingerprint_matches_the_avro_specification_test_vector() -> None:
    # Avro's own test data: the CRC-64-AVRO fingerprint of "int" is 0x7275d51a3f395c8f,
    # written little-endian in single-object encoding.
    assert fastavro.schema.fingerprint('"int"', "CRC-64-AVRO") == "8f5c393f1ad57572"


@pytest.mark.parametrize("event_type", sorted(EVENT_TYPES))
def test_golden_bytes(event_type: str) -> None:
    event = GOLDEN_EVENTS[event_type]
    expected = bytes.fromhex(GOLDEN_BYTES[event_type])
    assert codec.encode(event) == expected
    assert codec.decode(expected) == event


@pytest.mark.parametrize("event_type", sorted(EVENT_TYPES))
def test_frame_is_standard_single_object_encoding(event_type: str) -> None:
    """Another language's Avro library reads the body with only the .avsc file."""
    data = codec.encode(GOLDEN_EVENTS[event_type])
    schema = default_registry().current[event_type]
    assert data[:2] == MARKER
    assert data[2:10] == schema.fingerprint
    plain = fastavro.parse_schema(json.loads(json.dumps(dict(schema.schema))))
    body = fastavro.schemaless_reader(io.BytesIO(data[10:]), plain)
    assert body["event_id"] == GOLDEN_EVENTS[event_type].event_id


@pytest.mark.parametrize("event_type", sorted(EVENT_STRATEGIES))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_round_trip(event_type: str, data: st.DataObject) -> None:
    event: Event = data.draw(EVENT_STRATEGIES[event_type])
    decoded = codec.decode(codec.encode(event))
    assert decoded == event
    assert type(decoded) is type(event)


def test_attribute_types_survive() -> None:
    span = GOLDEN_EVENTS["SpanRecorded"]
    decoded = codec.decode(codec.encode(span))
    attrs = decoded.attributes  # type: ignore[attr-defined]
    assert attrs["stream"] is False
    assert type(attrs["gen_ai.usage.input_tokens"]) is int
    assert type(attrs["temperature"]) is float
    assert attrs["token_ids"] == [1, 2, 3]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_raise_decode_error_only(data: bytes) -> None:
    # A random buffer that happens to decode is fine; anything but DecodeError must not escape.
    with contextlib.suppress(DecodeError):
        codec.decode(data)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(GOLDEN_BYTES)), st.data())
def test_corrupted_bodies_raise_decode_error_only(event_type: str, data: st.DataObject) -> None:
    good = bytes.fromhex(GOLDEN_BYTES[event_type])
    position = data.draw(st.integers(10, len(good) - 1))
    flipped = bytearray(good)
    flipped[position] ^= data.draw(st.integers(1, 255))
    with contextlib.suppress(DecodeError):
        codec.decode(bytes(flipped))


@pytest.mark.parametrize(
    ("data", "kind", "words"),
    [
        (b"", "not_single_object", "single-object"),
        (b'{"json": true}', "not_single_object", "single-object"),
        (MARKER + b"\x00" * 8 + b"\x02", "unknown_schema", "unknown schema fingerprint"),
    ],
)
def test_decode_errors_say_why(data: bytes, kind: str, words: str) -> None:
    with pytest.raises(DecodeError) as info:
        codec.decode(data)
    assert info.value.kind == kind
    assert words in info.value.reason


def test_truncated_record_is_undecodable() -> None:
    good = bytes.fromhex(GOLDEN_BYTES["SpanRecorded"])
    with pytest.raises(DecodeError) as info:
        codec.decode(good[: len(good) // 2])
    assert info.value.kind == "undecodable"
    assert "SpanRecorded" in info.value.reason


def test_trailing_bytes_are_rejected() -> None:
    good = bytes.fromhex(GOLDEN_BYTES["RolloutCancelled"])
    with pytest.raises(DecodeError, match="trailing"):
        codec.decode(good + b"\x00")


def _raw_encode(event_type: str, datum: dict[str, object]) -> bytes:
    schema = default_registry().current[event_type]
    buffer = io.BytesIO()
    fastavro.schemaless_writer(buffer, schema.parsed, datum)
    return MARKER + schema.fingerprint + buffer.getvalue()


def test_schema_valid_but_semantically_invalid_event() -> None:
    datum = GOLDEN_EVENTS["RolloutQueued"].model_dump(mode="python")
    datum["input_json"] = "{not json"
    with pytest.raises(DecodeError) as info:
        codec.decode(_raw_encode("RolloutQueued", datum))
    assert info.value.kind == "invalid"
    assert "input_json" in info.value.reason and "JSON" in info.value.reason


def test_attempt_cannot_finish_as_running() -> None:
    datum = GOLDEN_EVENTS["AttemptFinished"].model_dump(mode="python")
    datum["status"] = "running"
    with pytest.raises(DecodeError, match="cannot finish"):
        codec.decode(_raw_encode("AttemptFinished", datum))


def test_negative_long_is_not_a_valid_sequence() -> None:
    datum = GOLDEN_EVENTS["SpanRecorded"].model_dump(mode="python")
    datum["sequence"] = -1
    with pytest.raises(DecodeError, match="sequence"):
        codec.decode(_raw_encode("SpanRecorded", datum))
