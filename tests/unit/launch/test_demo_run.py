"""The demo's (and Trainer.fit's) reading of a worker that stopped: a failure, unless the run
is being interrupted (Ctrl-C reaches the workers too, and one may stop first)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from agl_stream.launch.fit import FitError
from agl_stream.launch.run import RunFailed, raise_if_stopped


async def test_a_stopped_worker_is_a_failure_that_names_it_and_its_logs() -> None:
    raise_if_stopped(None, Path("/logs"))  # all running: nothing to say
    with pytest.raises(RunFailed, match=r"the projector process stopped; its log is in /logs"):
        raise_if_stopped("projector", Path("/logs"))
    with pytest.raises(FitError, match="the trainer process stopped"):
        raise_if_stopped("trainer", Path("/logs"), FitError)


async def test_a_worker_stopped_while_the_run_is_interrupted_is_the_interrupt() -> None:
    """The fit test's Ctrl-C once ended in "the projector process stopped" instead of
    KeyboardInterrupt: the cancellation had been swallowed by something awaited in between."""

    async def interrupted() -> None:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()  # what asyncio.run does on SIGINT
        with contextlib.suppress(asyncio.CancelledError):  # a library that swallows it
            await asyncio.sleep(1)
        raise_if_stopped("projector", Path("/logs"))

    with pytest.raises(asyncio.CancelledError):
        await asyncio.create_task(interrupted())
