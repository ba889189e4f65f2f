"""Running one attempt with no broker: sync agents' threads, the attempt's clocks, and the
spans of threads the agent starts itself."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from aiokafka.structs import RecordMetadata
from opentelemetry import context as otel_context

from agl_stream.agent import (
    LitAgent,
    Rollout,
    emit_message,
    emit_reward,
    in_attempt,
    rollout,
    tracing,
)
from agl_stream.agent import threads as agent_threads
from agl_stream.agent.api import load_agent
from agl_stream.agent.threads import AgentThreads
from agl_stream.agent.tracing import DroppedSpans, tracer
from agl_stream.events import AttemptStatus, Event, RolloutMode, RolloutQueued, SpanRecorded
from agl_stream.runner.attempt import AttemptHandle, Outcome, execute

# asyncio's default executor, which sync agents used to share: its size on this machine.
DEFAULT_EXECUTOR_THREADS = min(32, (os.cpu_count() or 1) + 4)


class Spans:
    """A Sender that keeps the spans it is given, as the broker has them at once."""

    def __init__(self) -> None:
        self.sent: list[SpanRecorded] = []

    async def send(self, short_topic: str, event: Event) -> asyncio.Future[RecordMetadata]:
        assert short_topic == "spans" and isinstance(event, SpanRecorded)
        self.sent.append(event)
        landed: asyncio.Future[RecordMetadata] = asyncio.get_running_loop().create_future()
        landed.set_result(None)  # type: ignore[arg-type]
        return landed


def queued(
    timeout: float | None = None, unresponsive: float | None = None, **task: Any
) -> RolloutQueued:
    return RolloutQueued(
        rollout_id=f"ro-{uuid.uuid4().hex[:8]}", attempt_number=1, input_json=json.dumps(task),
        mode=RolloutMode.TRAIN, timeout_seconds=timeout, unresponsive_seconds=unresponsive,
    )  # fmt: skip


async def run(agent: LitAgent, task: RolloutQueued, spans: Spans | None = None) -> Outcome:
    attempt = Rollout(task.rollout_id, uuid.uuid4().hex, 1, task.mode, None)
    return await execute(agent, task, attempt, {}, spans or Spans(), AttemptHandle())


async def test_sync_agents_beyond_the_default_executor_do_not_wait_out_their_timeout() -> None:
    """More sync attempts at once than asyncio's default executor has threads: those beyond it
    used to queue for a thread while their timeout ran, and timed out without having run
    longer than the agent takes."""
    agent = load_agent("tests.support.agents:sync_agent")  # sleeps task["sleep"] seconds
    tasks = [queued(timeout=1.0, sleep=0.6) for _ in range(DEFAULT_EXECUTOR_THREADS + 2)]
    outcomes = await asyncio.gather(*(run(agent, task) for task in tasks))
    assert [o.status for o in outcomes] == [AttemptStatus.SUCCEEDED] * len(tasks), [
        o.error for o in outcomes if o.error
    ]
    assert all(o.reward == 0.5 for o in outcomes)


class SlowToStart(AgentThreads):
    """Threads that take a while to pick an agent up (as a busy pool's would)."""

    async def run(
        self, func: Callable[..., Any], /, *args: Any, on_start: Callable[[], None] | None = None
    ) -> Any:
        await asyncio.sleep(0.8)
        return await super().run(func, *args, on_start=on_start)


async def test_the_clocks_start_when_the_sync_agent_starts_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(agent_threads, "AGENT_THREADS", SlowToStart())

    @rollout
    def quiet(task: dict[str, Any]) -> float:
        time.sleep(0.5)  # no span: only the attempt's clocks see it
        return 1.0

    # Counted from the attempt's creation, 0.8 + 0.5 s would be past both limits.
    timed, watched = await asyncio.gather(
        run(quiet, queued(timeout=1.0)), run(quiet, queued(unresponsive=1.0))
    )
    assert (timed.status, watched.status) == (AttemptStatus.SUCCEEDED, AttemptStatus.SUCCEEDED)


def test_a_hung_sync_agent_neither_starves_new_attempts_nor_holds_up_the_exit() -> None:
    release = threading.Event()

    @rollout
    def hung(task: dict[str, Any]) -> None:
        release.wait(20)

    @rollout
    def quick(task: dict[str, Any]) -> float:
        return 1.0

    before = agent_threads.AGENT_THREADS.abandoned

    async def attempts() -> tuple[list[Outcome], int]:
        stuck = await asyncio.gather(*(run(hung, queued(timeout=0.2)) for _ in range(8)))
        abandoned = agent_threads.AGENT_THREADS.abandoned - before
        return [*stuck, await run(quick, queued(timeout=1.0))], abandoned

    began = time.monotonic()
    try:
        # asyncio.run joins the default executor's threads at the end: with the agents on it,
        # this waited for the hung ones.
        outcomes, abandoned = asyncio.run(attempts())
        took = time.monotonic() - began
    finally:
        release.set()
    assert [o.status for o in outcomes] == [AttemptStatus.TIMEOUT] * 8 + [AttemptStatus.SUCCEEDED]
    assert took < 10
    assert abandoned == 8
    deadline = time.monotonic() + 10
    while agent_threads.AGENT_THREADS.abandoned > before:
        assert time.monotonic() < deadline, "the released agents' threads were not counted back"
        time.sleep(0.01)


async def test_agent_threads_are_reused_and_end_when_idle() -> None:
    pool = AgentThreads(idle_seconds=0.2)
    names = [await pool.run(lambda: threading.current_thread().ident) for _ in range(5)]
    assert len(set(names)) == 1 and pool.threads == 1  # one after another: one thread
    both = await asyncio.gather(*(pool.run(time.sleep, 0.2) for _ in range(2)))
    assert both == [None, None] and pool.threads == 2  # at once: a thread each
    with pytest.raises(ZeroDivisionError):
        await pool.run(lambda: 1 / 0)
    deadline = time.monotonic() + 5
    while pool.threads:
        assert time.monotonic() < deadline, "idle threads did not end"
        await asyncio.sleep(0.05)


# -- spans from threads the agent starts ----------------------------------------------------

EARLY_POOL = ThreadPoolExecutor(2)  # made before any attempt, as an agent module may


def names(spans: Spans) -> list[str]:
    return sorted(str(s.attributes.get("agl.message", s.name)) for s in spans.sent)


def check_one_trace(spans: Spans) -> None:
    """Every span in the attempt's trace, numbered 0..n-1."""
    (root,) = [s for s in spans.sent if s.name == "agl.attempt"]
    assert {s.trace_id for s in spans.sent} == {root.trace_id}
    assert sorted(s.sequence for s in spans.sent) == list(range(len(spans.sent)))


@rollout
def threaded(task: dict[str, Any]) -> None:
    def nested() -> None:
        emit_message("thread in a thread")

    def in_thread() -> None:
        emit_message("thread")
        inner = threading.Thread(target=nested)
        inner.start()
        inner.join()

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda i: emit_message(f"pool {i}"), range(3)))
    EARLY_POOL.submit(emit_message, "early pool").result()
    EARLY_POOL.submit(emit_reward, 0.25).result()


async def test_spans_from_threads_and_pools_a_sync_agent_starts_are_recorded() -> None:
    spans = Spans()
    outcome = await run(threaded, queued(), spans)
    assert outcome.status is AttemptStatus.SUCCEEDED, outcome.error
    assert names(spans) == [
        "agl.attempt", "agl.reward", "early pool", "pool 0", "pool 1", "pool 2", "thread",
        "thread in a thread",
    ]  # fmt: skip
    assert outcome.span_count == len(spans.sent)
    assert outcome.reward == 0.25  # emitted on a pool thread
    check_one_trace(spans)


@rollout
async def threaded_async(task: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    with tracer().start_as_current_span("step"):
        await loop.run_in_executor(None, emit_message, "default executor")
        thread = threading.Thread(target=emit_message, args=("thread",))
        thread.start()
        await asyncio.to_thread(thread.join)


async def test_spans_from_threads_an_async_agent_starts_are_recorded() -> None:
    spans = Spans()
    outcome = await run(threaded_async, queued(), spans)
    assert outcome.status is AttemptStatus.SUCCEEDED, outcome.error
    assert names(spans) == ["agl.attempt", "default executor", "step", "thread"]
    check_one_trace(spans)
    (step,) = [s for s in spans.sent if s.name == "step"]
    handed = [s for s in spans.sent if s.name == "agl.message"]
    assert {s.parent_span_id for s in handed} == {step.span_id}  # under the span they ran in


class Worker:
    """A long-lived thread taking work from a queue, started outside any attempt."""

    def __init__(self) -> None:
        self.work: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            self.work.get()()

    def do(self, func: Callable[[], None]) -> None:
        done = threading.Event()

        def step() -> None:
            try:
                func()
            finally:
                done.set()

        self.work.put(step)
        assert done.wait(5)


async def test_in_attempt_binds_work_that_another_thread_runs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    dropped = DroppedSpans()
    monkeypatch.setattr(tracing, "dropped_spans", dropped)
    worker = Worker()

    @rollout
    def agent(task: dict[str, Any]) -> None:
        worker.do(in_attempt(lambda: emit_message("bound")))
        # OpenTelemetry's own way: the trace's context handed over, not the attempt's.
        handed = otel_context.get_current()

        def traced() -> None:
            token = otel_context.attach(handed)
            try:
                emit_message("trace handed over")
            finally:
                otel_context.detach(token)

        worker.do(traced)
        worker.do(lambda: emit_message("not bound"))
        worker.do(lambda: emit_message("not bound either"))

    spans = Spans()
    with caplog.at_level(logging.WARNING, logger=tracing.__name__):
        outcome = await run(agent, queued(), spans)
    assert outcome.status is AttemptStatus.SUCCEEDED, outcome.error
    assert names(spans) == ["agl.attempt", "bound", "trace handed over"]
    check_one_trace(spans)
    # Not recorded, and not in silence: counted, and logged (once a minute at most).
    assert dropped.counts == {"unattributed": 2}
    (warning,) = [r.getMessage() for r in caplog.records if r.name == tracing.__name__]
    assert "'agl.message' was started outside any attempt" in warning
    assert "in_attempt" in warning


async def test_spans_that_end_after_their_attempt_are_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dropped = DroppedSpans()
    monkeypatch.setattr(tracing, "dropped_spans", dropped)
    release, done = threading.Event(), threading.Event()

    @rollout
    def leaves_a_thread(task: dict[str, Any]) -> None:
        def late() -> None:
            release.wait(5)
            emit_message("after the end")
            done.set()

        threading.Thread(target=late, daemon=True).start()

    spans = Spans()
    outcome = await run(leaves_a_thread, queued(), spans)
    release.set()
    assert done.wait(5)
    assert names(spans) == ["agl.attempt"] and outcome.span_count == 1
    assert dropped.counts == {"late": 1}


class SizedSpans(Spans):
    """A Sender that refuses what a lane refuses: an event too large to be a record."""

    async def send(self, short_topic: str, event: Event) -> asyncio.Future[RecordMetadata]:
        from agl_stream.bus.codec import Codec
        from agl_stream.bus.kafka import MAX_RECORD_BYTES
        from agl_stream.runner.lane import EventTooLarge

        size = len(Codec().encode(event))
        if size > MAX_RECORD_BYTES:
            raise EventTooLarge("too large", size, MAX_RECORD_BYTES)
        return await super().send(short_topic, event)


async def test_a_span_too_large_for_a_record_leaves_a_stand_in_saying_why() -> None:
    """It used to fail the attempt's job in the runner (the rollout left unfinished)."""

    @rollout
    async def verbose(task: dict[str, Any]) -> float:
        emit_message("x" * 2_000_000)
        emit_message("small")
        return 1.0

    spans = SizedSpans()
    outcome = await run(verbose, queued(), spans)
    assert outcome.status == AttemptStatus.SUCCEEDED
    assert outcome.span_count == len(spans.sent) == 4  # two messages, the reward, the attempt
    big = spans.sent[0]
    assert "over the record limit" in str(big.attributes["agl.span.too_large"])
    assert [s.sequence for s in spans.sent] == [0, 1, 2, 3]
