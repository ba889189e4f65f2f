"""Malformed records of every kind a consumer can meet, and the dead-letter kind each gets."""

from __future__ import annotations

import io
import os

import fastavro

from agl_stream.bus.codec import MARKER, Codec
from agl_stream.bus.schema_registry import default_registry
from tests.support.helpers import examples
from tests.support.strategies import EVENT_STRATEGIES

EVENT_TOPICS = {
    "tasks": "RolloutQueued",
    "rollouts": "AttemptFinished",
    "spans": "SpanRecorded",
    "resources": "ResourcesPublished",
    "workers": "WorkerHeartbeat",
}
# A perfectly good Avro record of a schema that is not agl-stream's.
FOREIGN = fastavro.parse_schema(
    {"type": "record", "name": "Invoice", "fields": [{"name": "amount", "type": "long"}]}
)

EXPECTED_KIND = {
    "random": "not_single_object",
    "foreign schema": "unknown_schema",
    "truncated": "undecodable",
    "wrong topic": "wrong_topic",
    "invalid": "invalid",
}


def foreign_record() -> bytes:
    body = io.BytesIO()
    fastavro.schemaless_writer(body, FOREIGN, {"amount": 12})
    fingerprint = bytes.fromhex(
        fastavro.schema.fingerprint(
            fastavro.schema.to_parsing_canonical_form(FOREIGN), "CRC-64-AVRO"
        )
    )
    return MARKER + fingerprint + body.getvalue()


def bad_records(codec: Codec, topic: str) -> dict[str, bytes]:
    """One record of each kind of bad, for a topic (its short name), by label."""
    good = codec.encode(examples(EVENT_STRATEGIES[EVENT_TOPICS[topic]], 1)[0])
    misplaced_type = "SpanRecorded" if topic != "spans" else "WorkerHeartbeat"
    records = {
        # Never a framing's first byte (00: Confluent; C3: single-object).
        "random": b"\xff" + os.urandom(63),
        "foreign schema": foreign_record(),
        "truncated": good[: len(good) // 2],
        "wrong topic": codec.encode(examples(EVENT_STRATEGIES[misplaced_type], 1)[0]),
    }
    if topic == "spans":  # Avro-valid, refused by the event model (and the projector's rows)
        records["invalid"] = invalid_span()
    return records


def invalid_span() -> bytes:
    """A SpanRecorded whose trace id is not 32 hex digits: Avro reads it, the model refuses."""
    schema = default_registry().current["SpanRecorded"]
    datum = examples(EVENT_STRATEGIES["SpanRecorded"], 1)[0].model_dump(mode="python")
    datum["trace_id"] = "not-a-trace-id"
    body = io.BytesIO()
    fastavro.schemaless_writer(body, schema.parsed, datum)
    return MARKER + schema.fingerprint + body.getvalue()
