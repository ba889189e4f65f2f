"""Routing the spans an attempt creates, in any thread, to that attempt's recorder.

A span belongs to the attempt whose context it was started in (`current_recorder`), or failing
that to the attempt whose trace it continues (a thread handed only OpenTelemetry's context).
Threads the agent starts (threading.Thread, ThreadPoolExecutor) carry its context along once
`Tracing.install` has run; for anything else, `in_attempt` binds a function to the attempt.
A span that no attempt can own is never dropped in silence: `dropped_spans` counts and logs it.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import ClassVar, ParamSpec, TypeVar

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider

from agl_stream.agent.spans import to_event
from agl_stream.events import SpanRecorded
from agl_stream.events.reward_rules import reward_policy, span_reward

TRACER_NAME = "agl_stream"
DROP_LOG_SECONDS = 60.0

log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")


class AttemptRecorder:
    """Collects the spans of one attempt in order, numbering them from 0, and its latest
    reward span's value. Thread-safe: sync agents run in threads. After close(), late spans
    (from an abandoned thread) are refused (and counted as dropped), so the count on the
    terminal event is exact."""

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

    def record(self, span: ReadableSpan) -> bool:
        """Add a span that ended; False if the attempt is closed."""
        with self._lock:
            if self._closed:
                return False
            self._events.append(to_event(span, self.rollout_id, self.attempt_id, len(self._events)))
            self.last_progress = time.monotonic()
            value = span_reward(span.name, span.attributes)
            if value is not None and reward_policy(span.attributes) is None:
                self.reward = value  # (a reward naming a policy is that policy's alone)
            return True

    def touch(self) -> None:
        """Progress that is not a span yet (an LLM call streaming through the gateway)."""
        self.last_progress = time.monotonic()

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


class DroppedSpans:
    """Spans that no attempt records, counted by reason and logged (a warning per reason at
    most every DROP_LOG_SECONDS, with the count so far): `unattributed`, started outside any
    attempt's context and trace; `late`, ended after their attempt was closed."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._logged_at: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, reason: str, span_name: str, attempt_id: str | None = None) -> None:
        now = time.monotonic()
        with self._lock:
            self.counts[reason] += 1
            total = self.counts[reason]
            due = now - self._logged_at.get(reason, -DROP_LOG_SECONDS) >= DROP_LOG_SECONDS
            if due:
                self._logged_at[reason] = now
        if not due:
            return
        if reason == "late":
            log.warning(
                "span %r ended after its attempt %s did and is dropped (%d late spans so far)",
                span_name, attempt_id, total,
            )  # fmt: skip
        else:
            log.warning(
                "span %r was started outside any attempt and is dropped (%d so far): if an "
                "agent started it on a thread of its own, run that work through "
                "agl_stream.agent.in_attempt",
                span_name, total,
            )  # fmt: skip


dropped_spans = DroppedSpans()


class AttemptSpanProcessor(SpanProcessor):
    """Hands every span that ends to the recorder of the attempt that started it: the one in
    its context, else the one whose trace it continues."""

    def __init__(self) -> None:
        # Span id -> the recorder of the attempt that started it, until the span ends. Weak:
        # a span that never ends (left open by an agent, or in a thread it abandoned) is
        # forgotten with its attempt instead of being kept for the life of the process.
        self._owners: weakref.WeakValueDictionary[int, AttemptRecorder] = (
            weakref.WeakValueDictionary()
        )
        # Trace id -> recorder, for the attempts' root spans still open.
        self._traces: weakref.WeakValueDictionary[int, AttemptRecorder] = (
            weakref.WeakValueDictionary()
        )
        self._lock = threading.Lock()

    def open_spans(self) -> int:
        """Spans started in attempts that have not ended (while their attempt is alive)."""
        with self._lock:
            return len(self._owners)

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        context = span.get_span_context()
        recorder = current_recorder.get()
        with self._lock:
            if recorder is None:
                recorder = self._traces.get(context.trace_id)
            elif span.parent is None:
                self._traces[context.trace_id] = recorder
            if recorder is not None:
                self._owners[context.span_id] = recorder
        if recorder is None:
            dropped_spans.add("unattributed", span.name)

    def on_end(self, span: ReadableSpan) -> None:
        context = span.get_span_context()
        if context is None:
            return
        with self._lock:
            recorder = self._owners.pop(context.span_id, None)
            attempt_root = span.parent is None and recorder is not None
            if attempt_root and self._traces.get(context.trace_id) is recorder:
                del self._traces[context.trace_id]
        if recorder is not None and not recorder.record(span):
            dropped_spans.add("late", span.name, recorder.attempt_id)


def in_attempt(func: Callable[P, T]) -> Callable[P, T]:
    """`func`, bound to the attempt it is wrapped in: the spans it starts are recorded for that
    attempt wherever it is called (a pool or a queue consumer made outside the attempt).
    Threads the agent starts itself (threading.Thread, ThreadPoolExecutor.submit) need no
    wrapping: they carry the attempt's context along."""
    context = contextvars.copy_context()

    @functools.wraps(func)
    def bound(*args: P.args, **kwargs: P.kwargs) -> T:
        # A copy per call: one context cannot be entered by two threads at once.
        return context.copy().run(func, *args, **kwargs)

    return bound


_thread_start = threading.Thread.start
_pool_submit = ThreadPoolExecutor.submit


def _start_with_attempt(self: threading.Thread) -> None:
    """Thread.start: a thread started inside an attempt runs in a copy of its context (as
    Python 3.14 does with -X thread_inherit_context=1); outside one, as before."""
    if current_recorder.get() is not None:
        run = self.run
        self.run = functools.partial(contextvars.copy_context().run, run)  # type: ignore[method-assign]
    _thread_start(self)


def _submit_in_context(
    self: Executor, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
) -> Future[T]:
    """ThreadPoolExecutor.submit: the call runs in a copy of the submitter's context (as
    asyncio.to_thread runs it), not in whatever context its pool thread was started in."""
    context = contextvars.copy_context()
    return _pool_submit(self, lambda: context.run(fn, *args, **kwargs))


def follow_attempts_into_threads() -> None:
    """Make threads and thread pools carry the attempt's context (idempotent)."""
    threading.Thread.start = _start_with_attempt  # type: ignore[method-assign]
    ThreadPoolExecutor.submit = _submit_in_context  # type: ignore[method-assign]


class Tracing:
    """One tracer provider per process, installed as the global one so that instrumented
    libraries (LLM clients) record into the current attempt too."""

    _installed: ClassVar[TracerProvider | None] = None

    @classmethod
    def install(cls, service_name: str = "agl-stream-runner") -> TracerProvider:
        if cls._installed is None:
            follow_attempts_into_threads()
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
