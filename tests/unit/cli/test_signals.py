"""How long-running commands learn to stop: SIGTERM always; Ctrl-C unless the process was
started with it ignored (a background job's, which its parent ignores too)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import pytest

from agl_stream.runtime.supervision import stop_on_signals


def _sigint(handler: object) -> Iterator[None]:
    before = signal.signal(signal.SIGINT, handler)  # type: ignore[arg-type]
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.fixture
def sigint_default() -> Iterator[None]:
    """As in a terminal (pytest itself may run as a background job, with it ignored)."""
    yield from _sigint(signal.default_int_handler)


@pytest.fixture
def sigint_ignored() -> Iterator[None]:
    yield from _sigint(signal.SIG_IGN)


async def _stopped_by(sig: signal.Signals) -> bool:
    stop = stop_on_signals()
    try:
        os.kill(os.getpid(), sig)
        try:
            await asyncio.wait_for(stop.wait(), 2)
        except TimeoutError:
            return False
        return True
    finally:
        loop = asyncio.get_running_loop()
        loop.remove_signal_handler(signal.SIGTERM)
        loop.remove_signal_handler(signal.SIGINT)


@pytest.mark.usefixtures("sigint_default")
async def test_sigterm_and_ctrl_c_stop_a_command() -> None:
    assert await _stopped_by(signal.SIGTERM)
    assert await _stopped_by(signal.SIGINT)


@pytest.mark.usefixtures("sigint_ignored")
async def test_a_command_started_with_ctrl_c_ignored_keeps_ignoring_it() -> None:
    assert not await _stopped_by(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert await _stopped_by(signal.SIGTERM)
