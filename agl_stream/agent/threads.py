"""The threads sync agents run on: each agent gets one the moment it is called, never a place
in a queue."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from agl_stream.agent.tracing import current_recorder

log = logging.getLogger(__name__)
T = TypeVar("T")

_Call = tuple[Future[Any], Callable[[], Any]]


class AgentThreads:
    """Runs each sync agent on a thread of its own from the moment it is called: an idle
    thread, or a new one when none is idle.

    Not a fixed-size pool: asyncio's default executor (what asyncio.to_thread uses) has
    min(32, cores + 4) threads, 6 on two cores. A runner with a higher --concurrency queued its
    sync attempts for a thread while their timeout clocks ran, and a timed-out agent (a thread
    cannot be stopped) kept its thread, so every one of them left one thread fewer for the
    attempts after it. Here the threads in use are the sync attempts running (at most the
    runner's concurrency) plus the threads still held by agents that ran past their attempt's
    end (`abandoned`, each logged): a new attempt never waits behind either. Those are leaked
    until their agent returns; no pool size bounds a leak that cannot be undone, and counting
    them against the runner's slots would let a few hung agents stop it from taking work.

    Threads are daemons, so a hung agent does not hold up the process at exit (asyncio.run
    joins the default executor's threads and would wait for it forever); idle threads end
    after `idle_seconds`, so there is nothing to shut down.
    """

    def __init__(self, idle_seconds: float = 30.0) -> None:
        self.idle_seconds = idle_seconds
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        # One permit per thread waiting for a call that no call has been promised to yet.
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._threads = 0
        self._abandoned = 0

    @property
    def threads(self) -> int:
        """Threads alive: running an agent, abandoned to one, or idle."""
        return self._threads

    @property
    def abandoned(self) -> int:
        """Agents still running whose attempt is over (timed out, cancelled, handed back)."""
        return self._abandoned

    async def run(
        self, func: Callable[..., T], /, *args: Any, on_start: Callable[[], None] | None = None
    ) -> T:
        """func(*args) on a thread of its own, in a copy of the caller's context (as
        asyncio.to_thread does); `on_start` is called on that thread just before."""
        context = contextvars.copy_context()

        def call() -> T:
            if on_start is not None:
                on_start()
            return context.run(func, *args)

        future: Future[T] = Future()
        self._calls.put((future, call))
        if not self._idle.acquire(blocking=False):
            self._start_thread()
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if not future.cancel() and not future.done():  # running: it cannot be stopped
                self._abandon(future, getattr(func, "__qualname__", repr(func)))
            raise

    def _abandon(self, future: Future[Any], name: str) -> None:
        with self._lock:
            self._abandoned += 1
            abandoned = self._abandoned
        log.warning(
            "sync agent %s runs on after its attempt ended (a thread cannot be stopped); "
            "%d abandoned agent thread(s) in this process",
            name,
            abandoned,
        )
        future.add_done_callback(lambda _: self._returned())

    def _returned(self) -> None:
        with self._lock:
            self._abandoned -= 1

    def _start_thread(self) -> None:
        with self._lock:
            self._threads += 1
        thread = threading.Thread(target=self._serve, name="agl-agent", daemon=True)
        # Started in an empty context: a thread started inside an attempt takes that attempt's
        # context (tracing.follow_attempts_into_threads), and this one serves many attempts.
        contextvars.Context().run(thread.start)

    def _serve(self) -> None:
        while True:
            try:
                future, call = self._calls.get(timeout=self.idle_seconds)
            except queue.Empty:
                if self._idle.acquire(blocking=False):
                    break  # idle for long, and no call was promised to this thread
                continue  # a call was promised meanwhile: it is in the queue
            if future.set_running_or_notify_cancel():
                result, error = _call(call)
                # Idle before the caller hears back: its next call gets this thread.
                self._idle.release()
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(error)
                del result, error
            else:
                self._idle.release()
            del future, call  # nothing of the attempt is kept alive while idle
        with self._lock:
            self._threads -= 1


def _call(call: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return call(), None
    except BaseException as exc:  # noqa: BLE001 (the caller's to raise, as in ThreadPoolExecutor)
        return None, exc


AGENT_THREADS = AgentThreads()


async def run_sync(func: Callable[..., T], /, *args: Any) -> T:
    """Run a sync agent on its own thread of AGENT_THREADS. The attempt's timeout and
    unresponsiveness clocks start when that thread starts running it."""
    recorder = current_recorder.get()
    on_start = recorder.start_clocks if recorder is not None else None
    return await AGENT_THREADS.run(func, *args, on_start=on_start)
