"""Spans of a worker's own units of work (an attempt as the runner handles it, a projector
batch, a trainer step, an APO round, a reload), apart from the agents' spans.

The agents' spans are data: they go through the process's global tracer provider to the
attempt that started them and on to the spans topic. A worker's spans come from a provider
of their own and are never made current, so an agent's span never gets a worker's span as
its parent, and a worker's span never reaches an attempt. Until OTLP export is on
(telemetry.otlp), NO_TRACER stands in: its spans are OpenTelemetry's invalid span, made by
no one, so a worker without export pays a method call per span.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, Span, Status, StatusCode
from opentelemetry.util.types import AttributeValue

Attributes = Mapping[str, AttributeValue]


class WorkerTracer:
    """Starts a worker's spans: roots, or children of a span given explicitly."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    def start(
        self, name: str, parent: Span | None = None, attributes: Attributes | None = None
    ) -> Span:
        """A span the caller ends (span.end())."""
        # An empty context, not the current one: a worker's root never joins an agent's trace.
        context = trace.set_span_in_context(parent) if parent is not None else Context()
        return self._tracer.start_span(name, context=context, attributes=attributes)

    def span(
        self, name: str, parent: Span | None = None, attributes: Attributes | None = None
    ) -> contextlib.AbstractContextManager[Span]:
        """A span around a block; an exception leaving it marks the span failed."""
        return self._span(name, parent, attributes)

    @contextlib.contextmanager
    def _span(
        self, name: str, parent: Span | None, attributes: Attributes | None
    ) -> Iterator[Span]:
        span = self.start(name, parent, attributes)
        try:
            yield span
        except BaseException as exc:
            fail(span, exc)
            raise
        finally:
            span.end()


def fail(span: Span, exc: BaseException) -> None:
    """Mark a span failed by `exc` (a cancellation says so without a stack trace)."""
    if isinstance(exc, asyncio.CancelledError):
        span.set_status(Status(StatusCode.ERROR, "cancelled"))
        return
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:500]))
    span.record_exception(exc)


class _NotRecorded(contextlib.AbstractContextManager[Span]):
    def __enter__(self) -> Span:
        return INVALID_SPAN

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        return None


class _NoTracer(WorkerTracer):
    """Spans that are not recorded, made as cheaply as can be."""

    def __init__(self) -> None:
        self._not_recorded = _NotRecorded()

    def start(self, *args: Any, **kwargs: Any) -> Span:
        return INVALID_SPAN

    def span(self, *args: Any, **kwargs: Any) -> contextlib.AbstractContextManager[Span]:
        return self._not_recorded


NO_TRACER: WorkerTracer = _NoTracer()
