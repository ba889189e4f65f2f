"""Routing the spans an attempt creates, in any thread, to that attempt's recorder."""

from __future__ import annotations

import contextvars
import functools
import threading
import time
from typing import ClassVar

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider

from agl_stream.agent.spans import to_event
from agl_stream.events import SpanRecorded

TRACER_NAME = "agl_stream"


class AttemptRecorder:
    """Collects the spans of one attempt in order, numbering them from 0. Thread-safe: sync
    agents run in threads. After close(), late spans (from an abandoned thread) are dropped,
    so the count on the terminal event is exact."""

    def __init__(self, rollout_id: str, attempt_id: str) -> None:
        self.rollout_id = rollout_id
        self.attempt_id = attempt_id
        self._lock = threading.Lock()
        self._events: list[SpanRecorded] = []
        self._closed = False
        self.running_since: float | None = None  # None: the agent has not started yet
        self.last_progress = time.monotonic()
        self.reward: float | None = None

    def start_clocks(self) -> None:
        """The agent starts running: the attempt's timeout and unresponsiveness clocks start
        now, not when the attempt was created. A sync agent's start again when its thread
        picks it up."""
        now = time.monotonic()
        self.running_since = now
        self.last_progress = now

    def record(self, span: ReadableSpan) -> None:
        with self._lock:
            if self._closed:
                return
            self._events.append(to_event(span, self.rollout_id, self.attempt_id, len(self._events)))
            self.last_progress = time.monotonic()

    def touch(self) -> None:
        """Progress that is not a span yet (an LLM call streaming through the gateway)."""
        self.last_progress = time.monotonic()

    def set_reward(self, value: float) -> None:
        self.reward = value

    def take(self, start: int) -> list[SpanRecorded]:
        """Spans recorded from index `start` on."""
        with self._lock:
            return self._events[start:]

    def close(self) -> int:
        with self._lock:
            self._closed = True
            return len(self._events)


current_recorder: contextvars.ContextVar[AttemptRecorder | None] = contextvars.ContextVar(
    "agl_current_recorder", default=None
)


class AttemptSpanProcessor(SpanProcessor):
    """Hands every span that ends to the recorder of the attempt that started it."""

    def __init__(self) -> None:
        self._owners: dict[int, AttemptRecorder] = {}
        self._lock = threading.Lock()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        recorder = current_recorder.get()
        context = span.get_span_context()
        if recorder is not None and context is not None:
            with self._lock:
                self._owners[context.span_id] = recorder

    def on_end(self, span: ReadableSpan) -> None:
        context = span.get_span_context()
        if context is None:
            return
        with self._lock:
            recorder = self._owners.pop(context.span_id, None)
        if recorder is not None:
            recorder.record(span)


class Tracing:
    """One tracer provider per process, installed as the global one so that instrumented
    libraries (LLM clients) record into the current attempt too."""

    _installed: ClassVar[TracerProvider | None] = None

    @classmethod
    def install(cls, service_name: str = "agl-stream-runner") -> TracerProvider:
        if cls._installed is None:
            provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
            provider.add_span_processor(AttemptSpanProcessor())
            trace.set_tracer_provider(provider)
            # set_tracer_provider refuses to replace an earlier provider; use what is global.
            global_provider = trace.get_tracer_provider()
            if global_provider is not provider and isinstance(global_provider, TracerProvider):
                global_provider.add_span_processor(AttemptSpanProcessor())
                provider = global_provider
            cls._installed = provider
        return cls._installed


@functools.cache
def tracer() -> trace.Tracer:
    """agl-stream's tracer (made once: emitters call this for every span)."""
    return Tracing.install().get_tracer(TRACER_NAME)
