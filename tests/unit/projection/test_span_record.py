"""The projector's span rows straight from Avro equal the rows built from the event model,
and a record the model refuses is refused here too, with the reason."""

from __future__ import annotations

import io
import uuid
from typing import Any

import fastavro
import orjson
import pytest
from hypothesis import given, settings

from agl_stream.bus.codec import MARKER, Codec, DecodeError
from agl_stream.bus.schema_registry import default_registry
from agl_stream.events import SpanRecorded
from agl_stream.projection.fold import span_row
from agl_stream.projection.rows import SpanRow, columns
from agl_stream.projection.span_record import span_row_from_datum
from tests.support.golden import GOLDEN_EVENTS
from tests.support.strategies import EVENT_STRATEGIES

codec = Codec()
JSON_COLUMNS = {"attributes", "events", "links", "resource"}


def stored(row: SpanRow) -> dict[str, Any]:
    """What PostgreSQL ends up holding: uuid as text, JSON columns as their JSON."""
    out = dict(zip(columns(SpanRow), row, strict=True))
    out["event_id"] = str(uuid.UUID(str(out["event_id"])))
    for name in JSON_COLUMNS:
        out[name] = orjson.loads(orjson.dumps(out[name]))
    return out


def plain(data: bytes) -> dict[str, Any]:
    return codec.decode_datum(data, plain=True)[1]


@settings(max_examples=200, deadline=None)
@given(EVENT_STRATEGIES["SpanRecorded"])
def test_rows_from_avro_equal_rows_from_the_event(event: SpanRecorded) -> None:
    row = span_row_from_datum(plain(codec.encode(event)))
    assert type(row) is SpanRow
    assert stored(row) == stored(span_row(codec.decode(codec.encode(event))))


def raw_span(**changes: Any) -> bytes:
    """A SpanRecorded written straight with fastavro: Avro-valid whatever the model says."""
    schema = default_registry().current["SpanRecorded"]
    datum = GOLDEN_EVENTS["SpanRecorded"].model_dump(mode="python") | changes
    body = io.BytesIO()
    fastavro.schemaless_writer(body, schema.parsed, datum)
    return MARKER + schema.fingerprint + body.getvalue()


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"rollout_id": ""}, "rollout_id"),
        ({"attempt_id": ""}, "attempt_id"),
        ({"sequence": -1}, "sequence"),
        ({"start_time_unix_nano": -5}, "start_time_unix_nano"),
        ({"trace_id": "ABCDEF" * 6}, "trace_id"),
        ({"span_id": "123"}, "span_id"),
        ({"parent_span_id": "zz" * 8}, "parent_span_id"),
        ({"events": [{"name": "e", "time_unix_nano": -1, "attributes": {}}]}, "time_unix_nano"),
        ({"links": [{"trace_id": "0" * 32, "span_id": "x", "attributes": {}}]}, "span_id"),
    ],
)
def test_what_the_model_refuses_is_refused_with_the_reason(
    changes: dict[str, Any], words: str
) -> None:
    data = raw_span(**changes)
    with pytest.raises(DecodeError) as model:
        codec.decode(data)
    assert model.value.kind == "invalid"
    with pytest.raises(ValueError, match=words):
        span_row_from_datum(plain(data))


def test_event_ids_in_other_spellings_are_read_as_the_model_reads_them() -> None:
    datum = plain(codec.encode(GOLDEN_EVENTS["SpanRecorded"]))
    canonical = datum["event_id"]
    for spelling in (canonical.upper(), canonical.replace("-", ""), "{" + canonical + "}"):
        assert span_row_from_datum(datum | {"event_id": spelling}).event_id == canonical
    with pytest.raises(ValueError, match="event_id 'not a uuid' is not a UUID"):
        span_row_from_datum(datum | {"event_id": "not a uuid"})


def test_a_time_past_the_calendar_is_refused() -> None:
    datum = plain(codec.encode(GOLDEN_EVENTS["SpanRecorded"]))
    with pytest.raises(ValueError, match="out of range"):
        span_row_from_datum(datum | {"occurred_at": 2**62})
