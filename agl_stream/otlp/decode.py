"""OTLP trace payloads into the OpenTelemetry project's own protobuf messages (the
`opentelemetry-proto` package: no hand-written protobuf). Pure; a payload that cannot be read
raises OtlpError with the reason (an HTTP 400, or a dead letter).

- binary protobuf (`application/x-protobuf`): an ExportTraceServiceRequest, which is also
  what an OpenTelemetry Collector's Kafka exporter writes with its `otlp_proto` encoding;
- OTLP/JSON (`application/json`): the protobuf JSON mapping with OTLP's differences
  (trace and span ids as hex, not base64; unknown fields ignored).
"""

from __future__ import annotations

import base64
import json
from typing import Any

from google.protobuf.json_format import ParseDict, ParseError
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
_ID_FIELDS = ("traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id")


class OtlpError(ValueError):
    """An OTLP payload that cannot be ingested; the message says why."""


def decode_request(body: bytes, content_type: str) -> ExportTraceServiceRequest:
    kind = content_type.split(";")[0].strip().lower()
    if kind == PROTOBUF:
        return decode_protobuf(body)
    if kind == JSON:
        return decode_json(body)
    raise OtlpError(f"content type {content_type!r} is not OTLP: send {PROTOBUF} or {JSON}")


def decode_protobuf(body: bytes) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except DecodeError as exc:
        raise OtlpError(f"not an OTLP ExportTraceServiceRequest (protobuf): {exc}") from None
    return request


def decode_json(body: bytes) -> ExportTraceServiceRequest:
    try:
        data = json.loads(body or b"null")
    except ValueError as exc:
        raise OtlpError(f"the body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise OtlpError("an OTLP/JSON body is a JSON object with resourceSpans")
    try:
        request = ExportTraceServiceRequest()
        ParseDict(_ids_as_base64(data), request, ignore_unknown_fields=True)
        return request
    except (ParseError, ValueError, TypeError) as exc:
        raise OtlpError(f"not an OTLP/JSON ExportTraceServiceRequest: {exc}") from None


def _ids_as_base64(value: Any) -> Any:
    """OTLP/JSON writes ids as hex; the protobuf JSON mapping reads bytes as base64."""
    if isinstance(value, list):
        return [_ids_as_base64(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for key, item in value.items():
        if key in _ID_FIELDS and isinstance(item, str):
            try:
                item = base64.b64encode(bytes.fromhex(item)).decode()
            except ValueError:
                raise OtlpError(f"{key} {item!r} is not hex") from None
        out[key] = _ids_as_base64(item)
    return out
