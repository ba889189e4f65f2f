"""The one place events become bytes and bytes become events.

Wire format: Avro single-object encoding (https://avro.apache.org/docs/current/specification/
#single-object-encoding): the marker C3 01, the 8-byte little-endian CRC-64-AVRO fingerprint
of the writer schema's Parsing Canonical Form, then the Avro binary body. Any Avro library
can produce and read it given the .avsc files.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from fastavro import schemaless_reader, schemaless_writer
from pydantic import ValidationError

from agl_stream.bus.schema_registry import SchemaRegistry, SchemaVersion, default_registry
from agl_stream.events import EVENT_TYPES, Event

MARKER = b"\xc3\x01"
HEADER_LENGTH = len(MARKER) + 8


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


class Codec:
    """Encodes events with the current schemas; decodes bytes written by any known release."""

    def __init__(self, registry: SchemaRegistry | None = None) -> None:
        self._registry = registry or default_registry()
        self._writers: Mapping[str, SchemaVersion] = self._registry.current
        self._by_fingerprint = self._registry.by_fingerprint
        missing = sorted(set(EVENT_TYPES) - set(self._writers))
        if missing:
            raise RuntimeError(f"no Avro schema under schemas/ for events {missing}")

    def encode(self, event: Event) -> bytes:
        schema = self._writers[event.type_name()]
        buffer = io.BytesIO()
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
        """The event type the record's schema fingerprint names (None: not a known one)."""
        if data is None or not data.startswith(MARKER):
            return None
        writer = self._by_fingerprint.get(data[len(MARKER) : HEADER_LENGTH])
        return None if writer is None else writer.event_type

    def decode_datum(self, data: bytes | None, plain: bool = False) -> tuple[SchemaVersion, Datum]:
        """The Avro body as read into the current schema, not yet validated as an event.
        `plain` leaves logical types as their Avro values (uuid as text, timestamp-micros
        as an integer) for callers that convert values themselves."""
        if data is None or len(data) < HEADER_LENGTH or not data.startswith(MARKER):
            raise DecodeError(
                "not an Avro single-object encoded record (expected marker C3 01 and a "
                "fingerprint)",
                "not_single_object",
            )
        fingerprint = data[len(MARKER) : HEADER_LENGTH]
        writer = self._by_fingerprint.get(fingerprint)
        if writer is None:
            raise DecodeError(
                f"unknown schema fingerprint {fingerprint.hex()}: not one of agl-stream's "
                "current or released event schemas",
                "unknown_schema",
            )
        reader = self._writers.get(writer.event_type)
        if reader is None:
            raise DecodeError(
                f"event type {writer.event_type} is no longer supported", "unknown_schema"
            )
        body = io.BytesIO(data[HEADER_LENGTH:])
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
        if body.tell() != len(data) - HEADER_LENGTH:
            raise DecodeError(
                f"{writer.event_type} body has {len(data) - HEADER_LENGTH - body.tell()} "
                "trailing bytes",
                "undecodable",
            )
        return writer, cast(Datum, datum)


def _to_datum(event: Event) -> dict[str, Any]:
    # Enums are StrEnums (already their Avro symbol); tuples are written as Avro arrays.
    return event.model_dump(mode="python")


def _one_line(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"]) or "event"
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)
