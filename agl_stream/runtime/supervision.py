"""Background tasks that never die silently.

The rule for every worker: each background task is supervised; a failure is logged with
its reason and either retried with backoff (`restarting`: a follower, heartbeats, a
span pump) or ends the worker with an error (`Supervisor`: the worker's loop waits through
`watch` and calls `check`, so a dead task stops it with a non-zero exit instead of leaving
it waiting forever).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import random
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

# A run that lasted this long before failing was healthy: the backoff starts over.
HEALTHY_SECONDS = 60.0


class BackgroundTaskFailed(RuntimeError):
    """A background task the worker cannot go on without has ended."""


class Unrecoverable(Exception):
    """An error that trying again cannot mend (refused credentials): `restarting` passes it
    on instead of retrying, so the worker stops with its reason."""


async def restarting(
    work: Callable[[], Awaitable[T]], what: str, first: float = 0.5, cap: float = 30.0
) -> T:
    """Run `work` until it returns; each failure is logged with its reason and `work` runs
    again after a jittered backoff from `first` to `cap` seconds."""
    loop = asyncio.get_running_loop()
    delay = first
    while True:
        began = loop.time()
        try:
            return await work()
        except Unrecoverable:
            raise
        except Exception as exc:  # noqa: BLE001 - logged with its reason, then retried
            log.warning("%s failed (%r); starting it again in %.1f s", what, exc, delay)
        if loop.time() - began > HEALTHY_SECONDS:
            delay = first
        await asyncio.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, cap)


class Supervisor:
    """The background tasks of one worker. A task that ends (other than cancelled) is
    logged and fails the worker: `check` raises, and `watch` stops waiting and raises."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._may_return: set[asyncio.Task[Any]] = set()
        self.failure: BackgroundTaskFailed | None = None
        self._failed = asyncio.Event()

    def spawn(
        self, work: Coroutine[Any, Any, Any], name: str, may_return: bool = False
    ) -> asyncio.Task[Any]:
        """Start `work`; `may_return`: returning is its way to stop (heartbeats that end
        when the worker is told to stop), only failing fails the worker."""
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        if may_return:
            self._may_return.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or self.failure is not None:
            return
        error = task.exception()
        if error is None and task in self._may_return:
            return
        reason = f"failed: {error!r}" if error is not None else "ended"
        log.error("%s %s", task.get_name(), reason, exc_info=error)
        self.failure = BackgroundTaskFailed(f"{task.get_name()} {reason}")
        self._failed.set()

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    async def watch(self, work: Awaitable[T]) -> T:
        """Await `work`, unless a background task fails first (then raise its failure)."""
        job = asyncio.ensure_future(work)
        failed = asyncio.ensure_future(self._failed.wait())
        try:
            await asyncio.wait({job, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
        if not job.done():
            job.cancel()
            await asyncio.gather(job, return_exceptions=True)
            self.check()
        return job.result()

    async def aclose(self) -> None:
        """Cancel every task and wait for them to end."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def __aenter__(self) -> Supervisor:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()


__all__ = ["BackgroundTaskFailed", "Supervisor", "restarting"]


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """For a child before exec (Popen's preexec_fn): killed when its parent dies, even by
    SIGKILL (Linux; elsewhere a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


async def unless_stopped(work: Awaitable[T], stop: asyncio.Event) -> T | None:
    """`work`'s result, or None when `stop` is set first (`work` is then cancelled, and what it
    raised meanwhile is of no interest): a process told to stop while it starts stops now,
    not after its start-up's own deadline."""
    job = asyncio.ensure_future(work)
    told = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({job, told}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        told.cancel()
    if job.done() and not stop.is_set():
        return job.result()
    job.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await job
    return None


def stop_on_signals() -> asyncio.Event:
    """An event that SIGTERM or Ctrl-C sets: how long-running commands learn to stop. A
    process started with Ctrl-C ignored (a shell's background job, `nohup`) keeps ignoring
    it, as its parent does: a Ctrl-C meant for a foreground job must not stop the workers
    of a Trainer.fit or demo running in the background while their parent goes on."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        loop.add_signal_handler(signal.SIGINT, stop.set)
    return stop
