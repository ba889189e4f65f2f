"""The one place events become bytes and bytes become events.

Wire format (agl_stream/bus/wire.py): Avro single-object encoding
(https://avro.apache.org/docs/current/specification/#single-object-encoding): the marker
C3 01, the 8-byte little-endian CRC-64-AVRO fingerprint of the writer schema's Parsing
Canonical Form, then the Avro binary body; any Avro library can produce and read it given the
.avsc files. Or, with AGL_STREAM_WIRE=confluent, the Confluent schema-registry framing: the
byte 00, the schema's registry id (4 bytes, big-endian), then the same body. Decoding reads
both, whatever this process writes.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, cast

from fastavro import schemaless_reader, schemaless_writer
from pydantic import ValidationError

from agl_stream.bus.registry_client import RegistryClient, SchemaIds, UnknownId
from agl_stream.bus.schema_registry import SchemaRegistry, SchemaVersion, default_registry
from agl_stream.bus.topic_spec import load_topic_specs
from agl_stream.bus.wire import (
    SINGLE_OBJECT_HEADER,
    SINGLE_OBJECT_MARKER,
    Framing,
    FramingError,
    confluent_header,
    split,
)
from agl_stream.events import EVENT_TYPES, Event
from agl_stream.runtime.config import KafkaSettings, WireSettings, load

MARKER = SINGLE_OBJECT_MARKER
HEADER_LENGTH = SINGLE_OBJECT_HEADER


class DecodeError(Exception):
    """A record that cannot become an event; `reason` is one line, fit for a DLQ header."""

    def __init__(self, reason: str, kind: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind  # not_single_object | unknown_schema | undecodable | invalid


Datum = dict[str, Any]  # an Avro record as fastavro reads it


@dataclass(frozen=True)
class Decoded:
    event: Event
    writer: SchemaVersion  # which schema the bytes were written with


@dataclass(frozen=True)
class Wire:
    """What a codec writes, and the registry ids it reads the Confluent framing with (None:
    no registry configured, so such records are dead-lettered as of an unknown schema)."""

    framing: Framing = Framing.SINGLE_OBJECT
    ids: SchemaIds | None = None


SINGLE_OBJECT = Wire()


@cache
def default_wire() -> Wire:
    """This process's wire, from AGL_STREAM_WIRE and AGL_STREAM_SCHEMA_REGISTRY_URL (one
    cache of schema ids for every codec of the process)."""
    settings = load(WireSettings)
    if settings.schema_registry_url is None:
        return SINGLE_OBJECT
    return Wire(Framing(settings.wire), schema_ids(settings.schema_registry_url))


def schema_ids(url: str, kafka: KafkaSettings | None = None) -> SchemaIds:
    """A cache of the ids of the registry at `url`, for topics named with `kafka`'s prefix."""
    prefix = (kafka or load(KafkaSettings)).topic_prefix
    topic_of = {
        event_type: spec.full_name(prefix)
        for spec in load_topic_specs().values()
        for event_type in spec.events
    }
    return SchemaIds(RegistryClient(url), default_registry(), topic_of)


class Codec:
    """Encodes events with the current schemas; decodes bytes written by any known release,
    in either framing."""

    def __init__(self, registry: SchemaRegistry | None = None, wire: Wire | None = None) -> None:
        self._registry = registry or default_registry()
        self.wire = wire or default_wire()
        self._writers: Mapping[str, SchemaVersion] = self._registry.current
        self._by_fingerprint = self._registry.by_fingerprint
        missing = sorted(set(EVENT_TYPES) - set(self._writers))
        if missing:
            raise RuntimeError(f"no Avro schema under schemas/ for events {missing}")

    def encode(self, event: Event) -> bytes:
        schema = self._writers[event.type_name()]
        buffer = io.BytesIO()
        if self.wire.framing is Framing.CONFLUENT:
            assert self.wire.ids is not None  # WireSettings insists on a registry
            buffer.write(confluent_header(self.wire.ids.writer_id(event.type_name())))
        else:
            buffer.write(MARKER)
            buffer.write(schema.fingerprint)
        schemaless_writer(buffer, schema.parsed, _to_datum(event))
        return buffer.getvalue()

    def decode(self, data: bytes | None) -> Event:
        return self.decode_with_writer(data).event

    def decode_with_writer(self, data: bytes | None) -> Decoded:
        writer, datum = self.decode_datum(data)
        try:
            event = EVENT_TYPES[writer.event_type].model_validate(datum)
        except ValidationError as exc:
            raise DecodeError(f"invalid {writer.event_type}: {_one_line(exc)}", "invalid") from exc
        return Decoded(event=event, writer=writer)

    def event_type_of(self, data: bytes | None) -> str | None:
        """The event type the record's schema names (None: not a known one)."""
        if data is None:
            return None
        if data.startswith(MARKER):
            writer = self._by_fingerprint.get(data[len(MARKER) : HEADER_LENGTH])
            return None if writer is None else writer.event_type
        try:
            return self._writer(data)[0].event_type
        except DecodeError:
            return None

    def decode_datum(self, data: bytes | None, plain: bool = False) -> tuple[SchemaVersion, Datum]:
        """The Avro body as read into the current schema, not yet validated as an event.
        `plain` leaves logical types as their Avro values (uuid as text, timestamp-micros
        as an integer) for callers that convert values themselves."""
        writer, start = self._writer(data)
        assert data is not None
        reader = self._writers.get(writer.event_type)
        if reader is None:
            raise DecodeError(
                f"event type {writer.event_type} is no longer supported", "unknown_schema"
            )
        body = io.BytesIO(data[start:])
        try:
            if plain:
                datum = schemaless_reader(body, writer.plain, reader.plain)
            else:
                datum = schemaless_reader(body, writer.parsed, reader.parsed)
        except Exception as exc:
            raise DecodeError(
                f"undecodable {writer.event_type} body: {type(exc).__name__}: {exc}",
                "undecodable",
            ) from exc
        if body.tell() != len(data) - start:
            raise DecodeError(
                f"{writer.event_type} body has {len(data) - start - body.tell()} trailing bytes",
                "undecodable",
            )
        return writer, cast(Datum, datum)

    def _writer(self, data: bytes | None) -> tuple[SchemaVersion, int]:
        """The schema a record was written with, and where its body starts."""
        if data is not None and len(data) >= HEADER_LENGTH and data.startswith(MARKER):
            fingerprint = data[len(MARKER) : HEADER_LENGTH]
            writer = self._by_fingerprint.get(fingerprint)
            if writer is None:
                raise DecodeError(
                    f"unknown schema fingerprint {fingerprint.hex()}: not one of agl-stream's "
                    "current or released event schemas",
                    "unknown_schema",
                )
            return writer, HEADER_LENGTH
        try:
            frame = split(data)
        except FramingError as exc:
            raise DecodeError(str(exc), "not_single_object") from None
        assert frame.schema_id is not None  # a single-object frame took the branch above
        if self.wire.ids is None:
            raise DecodeError(
                f"schema id {frame.schema_id} (Confluent framing): no schema registry is "
                "configured to look it up (AGL_STREAM_SCHEMA_REGISTRY_URL)",
                "unknown_schema",
            )
        found = self.wire.ids.writer_of(frame.schema_id)
        if isinstance(found, UnknownId):
            raise DecodeError(found.reason, "unknown_schema")
        return found, frame.body_start


def _to_datum(event: Event) -> dict[str, Any]:
    # Enums are StrEnums (already their Avro symbol); tuples are written as Avro arrays.
    return event.model_dump(mode="python")


def _one_line(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"]) or "event"
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)
