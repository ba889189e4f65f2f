"""Agent Lightning's spans as agl-stream's (SpanRecorded on the spans topic, rows of the read
model's spans table) and back.

What maps: ids, parent, name, status, attributes, events, links, times, resource attributes,
the span kind and the instrumentation scope. Agent Lightning's times are seconds (or None):
they travel as nanoseconds, None as 0. What does not travel: a context's trace_state and
is_remote (read back as {} and False), the resource's schema_url (read back as ""), and the
free-form extra fields of Agent Lightning's models.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentlightning.types import Event as AglEvent
from agentlightning.types import Link, OtelResource, Span, SpanContext, TraceStatus
from pydantic import ValidationError

from agl_stream.events import SpanEvent, SpanKind, SpanLink, SpanRecorded, SpanStatus, StatusCode

_KINDS = {k.value: k for k in SpanKind}


def _nanos(seconds: float | None) -> int:
    return 0 if not seconds else max(0, round(seconds * 1_000_000_000))


def _seconds(nanos: int | None) -> float | None:
    return None if not nanos else nanos / 1_000_000_000


def _kind(span: Span) -> SpanKind:
    extra = span.model_extra or {}
    raw = str(extra.get("kind", "")).rsplit(".", 1)[-1].upper()
    return _KINDS.get(raw, SpanKind.INTERNAL)


def _scope(span: Span) -> str | None:
    extra = span.model_extra or {}
    for key in ("instrumentation_scope", "instrumentation_info"):
        value = extra.get(key)
        if isinstance(value, Mapping) and isinstance(value.get("name"), str):
            return str(value["name"])
    return None


def to_event(span: Span) -> SpanRecorded:
    """The span as a SpanRecorded; ValueError names what agl-stream cannot keep (ids that
    are not OpenTelemetry hex, attribute values that are not scalars or lists of them)."""
    try:
        return SpanRecorded(
            rollout_id=span.rollout_id,
            attempt_id=span.attempt_id,
            sequence=span.sequence_id,
            trace_id=span.trace_id,
            span_id=span.span_id,
            parent_span_id=span.parent_id,
            name=span.name,
            kind=_kind(span),
            start_time_unix_nano=_nanos(span.start_time),
            end_time_unix_nano=_nanos(span.end_time),
            status=SpanStatus(
                code=StatusCode(span.status.status_code), description=span.status.description
            ),
            attributes=dict(span.attributes),
            events=tuple(
                SpanEvent(
                    name=e.name,
                    time_unix_nano=_nanos(e.timestamp),
                    attributes=dict(e.attributes),
                )
                for e in span.events
            ),
            links=tuple(
                SpanLink(
                    trace_id=link.context.trace_id,
                    span_id=link.context.span_id,
                    attributes=dict(link.attributes or {}),
                )
                for link in span.links
            ),
            resource=dict(span.resource.attributes),
            scope_name=_scope(span),
        )
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:3]
        )
        raise ValueError(f"span {span.span_id!r} cannot be stored: {problems}") from None


def from_row(row: Mapping[str, Any]) -> Span:
    """A spans-table row (as the read model holds it) as Agent Lightning's Span."""
    trace_id, span_id, parent = row["trace_id"], row["span_id"], row["parent_span_id"]
    return Span(
        rollout_id=row["rollout_id"],
        attempt_id=row["attempt_id"],
        sequence_id=row["sequence"],
        trace_id=trace_id,
        span_id=span_id,
        parent_id=parent,
        name=row["name"],
        status=TraceStatus(status_code=row["status_code"], description=row["status_description"]),
        attributes=row["attributes"],
        events=[
            AglEvent(
                name=e["name"],
                attributes=e.get("attributes") or {},
                timestamp=_seconds(e.get("time_unix_nano")),
            )
            for e in row["events"]
        ],
        links=[
            Link(
                context=SpanContext(
                    trace_id=link["trace_id"],
                    span_id=link["span_id"],
                    is_remote=False,
                    trace_state={},
                ),
                attributes=link.get("attributes") or None,
            )
            for link in row["links"]
        ],
        start_time=_seconds(row["start_time_unix_nano"]),
        end_time=_seconds(row["end_time_unix_nano"]),
        context=SpanContext(trace_id=trace_id, span_id=span_id, is_remote=False, trace_state={}),
        parent=(
            SpanContext(trace_id=trace_id, span_id=parent, is_remote=False, trace_state={})
            if parent
            else None
        ),
        resource=OtelResource(attributes=row["resource"], schema_url=""),
        kind=f"SpanKind.{row['kind']}",
    )
