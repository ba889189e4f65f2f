"""OpenTelemetry spans to SpanRecorded events (pure)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind as OtelKind
from opentelemetry.trace import StatusCode as OtelStatus

from agl_stream.events import SpanEvent, SpanKind, SpanLink, SpanRecorded, SpanStatus, StatusCode
from agl_stream.events.base import utc_now
from agl_stream.events.spans import AttributeValue

_KINDS = {
    OtelKind.INTERNAL: SpanKind.INTERNAL,
    OtelKind.SERVER: SpanKind.SERVER,
    OtelKind.CLIENT: SpanKind.CLIENT,
    OtelKind.PRODUCER: SpanKind.PRODUCER,
    OtelKind.CONSUMER: SpanKind.CONSUMER,
}
_STATUS = {
    OtelStatus.UNSET: StatusCode.UNSET,
    OtelStatus.OK: StatusCode.OK,
    OtelStatus.ERROR: StatusCode.ERROR,
}


def flatten(attributes: Mapping[str, Any], prefix: str = "") -> dict[str, AttributeValue]:
    """Nested dicts become dotted keys; sequences of scalars stay lists; anything else is
    its string form (OpenTelemetry attributes are scalars or lists of scalars)."""
    out: dict[str, AttributeValue] = {}
    for key, value in attributes.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}."))
        elif value is None or isinstance(value, bool | int | float | str):
            out[name] = value
        elif isinstance(value, list | tuple):
            if all(v is None or isinstance(v, bool | int | float | str) for v in value):
                out[name] = list(value)
            else:
                out.update(flatten({str(i): v for i, v in enumerate(value)}, f"{name}."))
        else:
            out[name] = str(value)
    return out


def _attrs(attributes: Mapping[str, Any] | None) -> dict[str, AttributeValue]:
    return flatten(dict(attributes or {}))


def to_event(span: ReadableSpan, rollout_id: str, attempt_id: str, sequence: int) -> SpanRecorded:
    """Built without re-validation: every field comes from the SDK in the right shape (ids
    formatted here, attributes flattened here), and this runs for every span."""
    context = span.get_span_context()
    assert context is not None
    parent = span.parent
    return SpanRecorded.model_construct(
        event_id=uuid.uuid4(),
        occurred_at=utc_now(),
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence=sequence,
        trace_id=f"{context.trace_id:032x}",
        span_id=f"{context.span_id:016x}",
        parent_span_id=f"{parent.span_id:016x}" if parent is not None else None,
        name=span.name,
        kind=_KINDS.get(span.kind, SpanKind.INTERNAL),
        start_time_unix_nano=span.start_time or 0,
        end_time_unix_nano=span.end_time or span.start_time or 0,
        status=SpanStatus(
            code=_STATUS[span.status.status_code], description=span.status.description
        ),
        attributes=_attrs(span.attributes),
        events=tuple(
            SpanEvent.model_construct(
                name=e.name, time_unix_nano=e.timestamp, attributes=_attrs(e.attributes)
            )
            for e in span.events
        ),
        links=tuple(
            SpanLink.model_construct(
                trace_id=f"{link.context.trace_id:032x}",
                span_id=f"{link.context.span_id:016x}",
                attributes=_attrs(link.attributes),
            )
            for link in span.links
        ),
        resource=_attrs(span.resource.attributes),
        scope_name=span.instrumentation_scope.name if span.instrumentation_scope else None,
    )
