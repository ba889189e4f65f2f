"""OTLP payloads as another system would send them, built with opentelemetry-proto's classes."""

from __future__ import annotations

from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import (
    AnyValue,
    ArrayValue,
    InstrumentationScope,
    KeyValue,
    KeyValueList,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

T0 = 1_795_240_800_000_000_000


def value(v: Any) -> AnyValue:
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    if isinstance(v, bytes):
        return AnyValue(bytes_value=v)
    if isinstance(v, list):
        return AnyValue(array_value=ArrayValue(values=[value(x) for x in v]))
    if isinstance(v, dict):
        return AnyValue(kvlist_value=KeyValueList(values=kvs(v)))
    return AnyValue(string_value=str(v))


def kvs(attributes: dict[str, Any]) -> list[KeyValue]:
    return [KeyValue(key=k, value=value(v)) for k, v in attributes.items()]


def span(trace: int, span_id: int, name: str, parent: int | None = None, **attributes: Any) -> Span:
    return Span(
        trace_id=trace.to_bytes(16, "big"), span_id=span_id.to_bytes(8, "big"),
        parent_span_id=parent.to_bytes(8, "big") if parent else b"", name=name,
        kind=Span.SPAN_KIND_CLIENT, start_time_unix_nano=T0 + span_id,
        end_time_unix_nano=T0 + span_id + 1000,
        status=Status(code=Status.STATUS_CODE_ERROR, message="boom") if "fail" in name else None,
        attributes=kvs(attributes),
    )  # fmt: skip


def request(
    spans: list[Span], resource: dict[str, Any] | None = None, scope: str = "app"
) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest(
        resource_spans=[
            ResourceSpans(
                resource=Resource(attributes=kvs({"service.name": "shop", **(resource or {})})),
                scope_spans=[ScopeSpans(scope=InstrumentationScope(name=scope), spans=spans)],
            )
        ]
    )


def otlp_json(message: ExportTraceServiceRequest) -> dict[str, Any]:
    """OTLP/JSON as a collector writes it: camelCase, ids as hex, enums as numbers."""
    from google.protobuf.json_format import MessageToDict

    data = MessageToDict(message, use_integers_for_enums=True)

    def hexify(node: Any) -> Any:
        if isinstance(node, list):
            return [hexify(n) for n in node]
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                if k in ("traceId", "spanId", "parentSpanId") and isinstance(v, str):
                    import base64

                    v = base64.b64decode(v).hex()
                out[k] = hexify(v)
            return out
        return node

    return hexify(data)  # type: ignore[no-any-return]
