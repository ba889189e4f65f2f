"""Running one attempt with no broker: sync agents' threads and the attempt's clocks."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from aiokafka.structs import RecordMetadata

from agl_stream.agent import LitAgent, Rollout, rollout
from agl_stream.agent import threads as agent_threads
from agl_stream.agent.api import load_agent
from agl_stream.agent.threads import AgentThreads
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
    agent = load_agent("tests.agents:sync_agent")  # sleeps task["sleep"] seconds
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
