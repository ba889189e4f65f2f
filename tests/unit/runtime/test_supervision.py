"""Background tasks never die silently: retried with a logged reason, or they fail the
worker that waits on them."""

from __future__ import annotations

import asyncio
import logging

import pytest

from agl_stream.runtime import supervision
from agl_stream.runtime.supervision import (
    BackgroundTaskFailed,
    Supervisor,
    restarting,
    unless_stopped,
)


async def test_a_failing_task_is_logged_and_started_again(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(supervision.random, "random", lambda: 0.0)
    runs = 0

    async def flaky() -> str:
        nonlocal runs
        runs += 1
        if runs < 3:
            raise ConnectionError(f"broker gone ({runs})")
        return "done"

    with caplog.at_level(logging.WARNING, logger="agl_stream.runtime.supervision"):
        assert await restarting(flaky, "the follower", first=0.01) == "done"
    assert runs == 3
    assert [r.getMessage() for r in caplog.records] == [
        "the follower failed (ConnectionError('broker gone (1)')); starting it again in 0.0 s",
        "the follower failed (ConnectionError('broker gone (2)')); starting it again in 0.0 s",
    ]


async def test_a_dead_background_task_ends_the_wait_with_its_reason() -> None:
    async def dies() -> None:
        await asyncio.sleep(0.01)
        raise ValueError("cannot read the topic")

    async with Supervisor() as background:
        background.spawn(dies(), "the resources follower")
        never = asyncio.Event()
        with pytest.raises(BackgroundTaskFailed, match="the resources follower failed: Value"):
            await asyncio.wait_for(background.watch(never.wait()), 5)
        with pytest.raises(BackgroundTaskFailed):
            background.check()


async def test_a_task_that_returns_when_it_must_not_also_fails_the_worker() -> None:
    async def returns() -> None:
        return None

    async with Supervisor() as background:
        background.spawn(returns(), "the heartbeats")
        await asyncio.sleep(0.01)
        with pytest.raises(BackgroundTaskFailed, match="the heartbeats ended"):
            background.check()


async def test_a_task_whose_return_is_its_stop_is_no_failure() -> None:
    async def heartbeats_until_told() -> None:
        return None

    async with Supervisor() as background:
        background.spawn(heartbeats_until_told(), "the heartbeats", may_return=True)
        await asyncio.sleep(0.01)
        background.check()


async def test_watch_returns_what_it_waited_for_and_close_cancels_the_rest() -> None:
    async with Supervisor() as background:
        forever = background.spawn(asyncio.Event().wait(), "a follower")

        async def answer() -> int:
            return 42

        assert await background.watch(answer()) == 42
    assert forever.cancelled()
    background.check()  # a cancelled task is no failure


async def test_a_stop_during_a_start_ends_the_wait_at_once_and_cancels_the_start() -> None:
    stop, cancelled = asyncio.Event(), asyncio.Event()

    async def start() -> str:  # a start-up that waits out its own long deadline
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "started"

    asyncio.get_running_loop().call_later(0.05, stop.set)
    assert await asyncio.wait_for(unless_stopped(start(), stop), 5) is None
    assert cancelled.is_set()


async def test_a_start_that_ends_first_gives_its_result_or_its_error() -> None:
    stop = asyncio.Event()

    async def start() -> str:
        return "started"

    async def refused() -> str:
        raise RuntimeError("the port is taken")

    assert await unless_stopped(start(), stop) == "started"
    with pytest.raises(RuntimeError, match="the port is taken"):
        await unless_stopped(refused(), stop)
    stop.set()  # told to stop already: the start is not waited for, whatever it says
    assert await unless_stopped(refused(), stop) is None
