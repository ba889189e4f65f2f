"""The two framings an event's bytes may have on a topic, told apart by their first byte (pure).

- Avro single-object encoding: the marker C3 01, the 8-byte CRC-64-AVRO fingerprint of the
  writer schema, then the Avro binary body. Needs no server: every reader holds the schemas.
- Confluent schema-registry framing: the magic byte 00, the writer schema's registry id as a
  4-byte big-endian integer, then the Avro binary body. What Confluent's, Apicurio's and most
  other Kafka serializers write and read, given the registry.

Every consumer reads both, so producers can move from one to the other one at a time.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import StrEnum

SINGLE_OBJECT_MARKER = b"\xc3\x01"
SINGLE_OBJECT_HEADER = len(SINGLE_OBJECT_MARKER) + 8
CONFLUENT_MAGIC = b"\x00"
CONFLUENT_HEADER = len(CONFLUENT_MAGIC) + 4
_SCHEMA_ID = struct.Struct(">i")  # Confluent's ids are Java ints: signed, big-endian
MAX_SCHEMA_ID = 2**31 - 1


class Framing(StrEnum):
    """What a producer writes (AGL_STREAM_WIRE)."""

    SINGLE_OBJECT = "single-object"
    CONFLUENT = "confluent"


class FramingError(ValueError):
    """Bytes in neither framing; the message is one line, fit for a dead-letter reason."""


@dataclass(frozen=True)
class Frame:
    """Where a record's schema is named and where its Avro body starts."""

    framing: Framing
    fingerprint: bytes | None  # single-object: the writer schema's fingerprint
    schema_id: int | None  # confluent: the writer schema's registry id
    body_start: int


def split(data: bytes | None) -> Frame:
    """The frame of a record's value; FramingError when it has neither framing."""
    if data is not None and data.startswith(SINGLE_OBJECT_MARKER):
        if len(data) >= SINGLE_OBJECT_HEADER:
            fingerprint = data[len(SINGLE_OBJECT_MARKER) : SINGLE_OBJECT_HEADER]
            return Frame(Framing.SINGLE_OBJECT, fingerprint, None, SINGLE_OBJECT_HEADER)
    elif data is not None and data.startswith(CONFLUENT_MAGIC) and len(data) >= CONFLUENT_HEADER:
        (schema_id,) = _SCHEMA_ID.unpack_from(data, len(CONFLUENT_MAGIC))
        return Frame(Framing.CONFLUENT, None, schema_id, CONFLUENT_HEADER)
    raise FramingError(
        "neither Avro single-object encoded (marker C3 01 and a fingerprint) nor in the "
        "Confluent schema-registry framing (magic byte 00 and a schema id)"
    )


def confluent_header(schema_id: int) -> bytes:
    """The 5 bytes before the body of a record written with registry schema `schema_id`."""
    if not 0 <= schema_id <= MAX_SCHEMA_ID:
        raise ValueError(f"a schema id is between 0 and {MAX_SCHEMA_ID}, not {schema_id}")
    return CONFLUENT_MAGIC + _SCHEMA_ID.pack(schema_id)


def subject(topic: str, record_name: str) -> str:
    """The registry subject of one event type on one topic: Confluent's
    TopicRecordNameStrategy (<topic>-<full record name>). Topics carry several event types,
    so the one-subject-per-topic default (<topic>-value) would have the registry judge
    RolloutQueued's compatibility against RolloutCancelled's."""
    return f"{topic}-{record_name}"
