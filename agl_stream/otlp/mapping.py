"""OTLP spans as agl-stream's SpanRecorded events, mapped to rollouts and attempts (pure).

Which rollout and attempt a span belongs to, looked up on the span's attributes first, then
on its resource's (for producers in any language):

- `agl.rollout.id`: the rollout. Absent: the span's trace is an unattributed rollout of
  its own, `otlp-trace-<trace id>`.
- `agl.attempt.id`: the attempt. Absent: `otlp-<trace id>`, one attempt per trace.
- `agl.attempt.key`: the attempt's key, for a span that joins an attempt the ingester did
  not start (below). Never stored: it is taken off the span and its resource.
- `agl.rollout.mode`: train, val or test, for a rollout nobody queued. Absent: test (not
  trained on).
- `agl.rollout.input`: the task input (JSON text), for a rollout nobody queued. Absent:
  `{"trace_id": "<trace id>"}`.

**Which attempts a span may join.** An ingested span adds to an attempt the ingester starts
itself, or to an attempt whose key it carries; never to another. The ingester's attempts live
in an id namespace of their own: their ids begin with `otlp-` (`otlp-<trace id>`, or an
`agl.attempt.id` that begins so), which no runner, gateway session or store facade uses
(they start attempts as 32 hex digits, `gateway-sessions-...` and `at-...`). Each gets an
AttemptStarted (worker `otlp`, its task from the attributes above) the first time an ingester
sees it, so rewards can be given to it. Nothing says when a trace is over: an ingested
attempt ends after an idle timeout (agl_stream.otlp.idle), and trainers then train on the
train-mode ones. A span naming any other attempt joins it
only with `agl.attempt.key` = `attempt_key(secret, rollout id, attempt id)`: an HMAC-SHA256
under the secret the deployment gives its ingester (its token), which whoever starts the
attempt can compute and hand to what sends its spans; such a span is published as it is, with
no AttemptStarted (the attempt is its starter's). A span naming another attempt without its
key, or with a wrong one, refuses its payload with the reason, so nobody who can reach an
ingester can add a span (a reward of -100, say) to an attempt a runner ran.

A span's sequence number in its attempt is its span id read as a number (the low 63 bits), so
the same span sent twice (a retried export, a replayed topic) is one span in the read model.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from pydantic import ValidationError

from agl_stream.events import (
    AttemptStarted,
    AttemptTask,
    RolloutMode,
    SpanEvent,
    SpanKind,
    SpanLink,
    SpanRecorded,
    SpanStatus,
    StatusCode,
)
from agl_stream.events.spans import Attributes, AttributeValue
from agl_stream.otlp.decode import OtlpError

ROLLOUT_ID = "agl.rollout.id"
ATTEMPT_ID = "agl.attempt.id"
ATTEMPT_KEY = "agl.attempt.key"
MODE = "agl.rollout.mode"
INPUT = "agl.rollout.input"
UNATTRIBUTED_PREFIX = "otlp-trace-"
OWN_ATTEMPT_PREFIX = "otlp-"  # the ids of the attempts ingesters start
_KEY_CONTEXT = b"agl-stream attempt key"
WORKER = "otlp"
_KINDS = {
    Span.SPAN_KIND_SERVER: SpanKind.SERVER,
    Span.SPAN_KIND_CLIENT: SpanKind.CLIENT,
    Span.SPAN_KIND_PRODUCER: SpanKind.PRODUCER,
    Span.SPAN_KIND_CONSUMER: SpanKind.CONSUMER,
}
_CODES = {Status.STATUS_CODE_OK: StatusCode.OK, Status.STATUS_CODE_ERROR: StatusCode.ERROR}
_SEQUENCE_BITS = (1 << 63) - 1
_LAST_NANOS = (1 << 63) - 1


@dataclass(frozen=True)
class Mapped:
    """What one OTLP payload becomes: the ingester's own attempts it names (to announce when
    new) and its spans, in the order they came."""

    attempts: dict[tuple[str, str], AttemptStarted]
    spans: list[SpanRecorded]


def attempt_key(secret: str, rollout_id: str, attempt_id: str) -> str:
    """The key that lets an ingested span join attempt `attempt_id` of `rollout_id` (hex)."""
    message = b"\0".join((_KEY_CONTEXT, rollout_id.encode(), attempt_id.encode()))
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def map_request(request: ExportTraceServiceRequest, secret: str | None = None) -> Mapped:
    """Every span of the payload; OtlpError names the first one that cannot be a span, or
    that names an attempt it may not join (`secret`: what attempt keys are checked with;
    None: only the ingester's own attempts can be joined)."""
    attempts: dict[tuple[str, str], AttemptStarted] = {}
    spans: list[SpanRecorded] = []
    for r, resource_spans in enumerate(request.resource_spans):
        resource = attributes(resource_spans.resource.attributes)
        resource_key = resource.pop(ATTEMPT_KEY, None)
        for s, scope_spans in enumerate(resource_spans.scope_spans):
            scope = scope_spans.scope.name or None
            for i, span in enumerate(scope_spans.spans):
                where = f"resource_spans[{r}].scope_spans[{s}].spans[{i}]"
                own = attributes(span.attributes)
                given = own.pop(ATTEMPT_KEY, resource_key)
                event = _span(span, own, resource, scope, where)
                spans.append(event)
                key = (event.rollout_id, event.attempt_id)
                if given is not None:
                    _check_key(given, secret, event, where)
                elif not event.attempt_id.startswith(OWN_ATTEMPT_PREFIX):
                    raise OtlpError(
                        f"{where} names attempt {event.attempt_id!r} of rollout "
                        f"{event.rollout_id!r}, which no OTLP ingester started (theirs begin "
                        f"with {OWN_ATTEMPT_PREFIX!r}): a span joins another attempt only "
                        f"with that attempt's key in {ATTEMPT_KEY}"
                    )
                elif key not in attempts:
                    attempts[key] = _attempt(event, {**resource, **event.attributes})
    return Mapped(attempts, spans)


def _check_key(given: AttributeValue, secret: str | None, span: SpanRecorded, where: str) -> None:
    if secret is None:
        raise OtlpError(
            f"{where} carries {ATTEMPT_KEY}, but this ingester has no token to check it with "
            "(start it with AGL_STREAM_API_TOKEN)"
        )
    wanted = attempt_key(secret, span.rollout_id, span.attempt_id)
    if not isinstance(given, str) or not hmac.compare_digest(given.encode(), wanted.encode()):
        raise OtlpError(
            f"{where}: {ATTEMPT_KEY} is not the key of attempt {span.attempt_id!r} of "
            f"rollout {span.rollout_id!r}"
        )


def _span(
    span: Span, own: Attributes, resource: Attributes, scope: str | None, where: str
) -> SpanRecorded:
    trace_id, span_id = (
        _id(span.trace_id, 16, where, "trace_id"),
        _id(span.span_id, 8, where, "span_id"),
    )
    rollout_id = _text(own, resource, ROLLOUT_ID) or f"{UNATTRIBUTED_PREFIX}{trace_id}"
    attempt_id = _text(own, resource, ATTEMPT_ID) or f"{OWN_ATTEMPT_PREFIX}{trace_id}"
    try:
        return SpanRecorded(
            rollout_id=rollout_id, attempt_id=attempt_id,
            sequence=int(span_id, 16) & _SEQUENCE_BITS, trace_id=trace_id, span_id=span_id,
            parent_span_id=_id(span.parent_span_id, 8, where, "parent_span_id") or None,
            name=span.name, kind=_KINDS.get(span.kind, SpanKind.INTERNAL),
            start_time_unix_nano=_nanos(span.start_time_unix_nano, where, "start_time_unix_nano"),
            end_time_unix_nano=_nanos(span.end_time_unix_nano, where, "end_time_unix_nano"),
            status=SpanStatus(
                code=_CODES.get(span.status.code, StatusCode.UNSET),
                description=span.status.message or None,
            ),
            attributes=own,
            events=tuple(
                SpanEvent(name=e.name,
                          time_unix_nano=_nanos(e.time_unix_nano, where, "events.time_unix_nano"),
                          attributes=attributes(e.attributes))
                for e in span.events
            ),
            links=tuple(
                SpanLink(trace_id=_id(link.trace_id, 16, where, "links.trace_id"),
                         span_id=_id(link.span_id, 8, where, "links.span_id"),
                         attributes=attributes(link.attributes))
                for link in span.links
            ),
            resource=resource, scope_name=scope,
        )  # fmt: skip
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise OtlpError(f"{where} cannot be a span: {problems}") from None


def _attempt(span: SpanRecorded, seen: Attributes) -> AttemptStarted:
    mode = seen.get(MODE, RolloutMode.TEST.value)
    if mode not in {m.value for m in RolloutMode}:
        raise OtlpError(f"{MODE} is {mode!r}: one of train, val, test")
    given = seen.get(INPUT)
    task_input = given if isinstance(given, str) else json.dumps({"trace_id": span.trace_id})
    try:
        task = AttemptTask(
            input_json=task_input, mode=RolloutMode(mode), metadata={"source": "otlp"}
        )
    except ValidationError:
        raise OtlpError(f"{INPUT} must be JSON text") from None
    return AttemptStarted(
        rollout_id=span.rollout_id, attempt_id=span.attempt_id, attempt_number=1,
        worker_id=WORKER, task=task,
    )  # fmt: skip


def _text(own: Attributes, resource: Attributes, key: str) -> str | None:
    for source in (own, resource):
        value = source.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def _nanos(value: int, where: str, what: str) -> int:
    # OTLP's times are unsigned 64-bit, Avro's longs signed: past 2262 no event can hold one.
    if value > _LAST_NANOS:
        raise OtlpError(f"{where}: {what} is {value}, after the last time a span can hold")
    return value


def _id(raw: bytes, size: int, where: str, what: str) -> str:
    if not raw:
        if what == "parent_span_id":
            return ""
        raise OtlpError(f"{where}: {what} is missing")
    if len(raw) != size or not any(raw):
        raise OtlpError(f"{where}: {what} must be {size} bytes, not all zero (got {len(raw)})")
    return raw.hex()


def attributes(items: Sequence[KeyValue] | Iterable[KeyValue]) -> Attributes:
    """OTLP key-values as flat span attributes: nested lists and maps flattened with dotted
    keys (`a.0`, `a.b`), bytes as hex, non-finite doubles as text."""
    out: dict[str, AttributeValue] = {}
    for item in items:
        _flatten(item.key, item.value, out)
    return out


def _flatten(key: str, value: AnyValue, out: dict[str, AttributeValue]) -> None:
    kind = value.WhichOneof("value")
    if kind == "kvlist_value":
        for item in value.kvlist_value.values:
            _flatten(f"{key}.{item.key}", item.value, out)
    elif kind == "array_value":
        scalars = [_scalar(v) for v in value.array_value.values]
        if all(s is not _NOT_SCALAR for s in scalars):
            out[key] = scalars
        else:
            for i, v in enumerate(value.array_value.values):
                _flatten(f"{key}.{i}", v, out)
    else:
        scalar = _scalar(value)
        out[key] = None if scalar is _NOT_SCALAR else scalar


_NOT_SCALAR = object()


def _scalar(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "int_value":
        return value.int_value
    if kind == "double_value":
        number = value.double_value
        return number if math.isfinite(number) else str(number)
    if kind == "bytes_value":
        return value.bytes_value.hex()
    if kind is None:
        return None
    return _NOT_SCALAR
