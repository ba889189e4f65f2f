"""The store's projector as a child process (`python -m agl_stream.projection`), restarted when it
fails, stopped with the store, and killed with it even by SIGKILL.

A process, not a thread: the projector's decoding and batching hold Python's GIL, and in the
store's process they held up the store's calls (each waiting for the GIL after every socket
write). Its settings travel as AGL_STREAM_* variables (runtime.config.child_environment); its
log goes where the store's goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys

from agl_stream.runtime.config import DatabaseSettings, KafkaSettings, child_environment
from agl_stream.runtime.supervision import die_with_parent, restarting

log = logging.getLogger(__name__)
COMMAND = (sys.executable, "-m", "agl_stream.projection")
STOP_SECONDS = 10.0


class ProjectorProcess:
    """Runs and watches the projector process from the store's event loop."""

    def __init__(self, kafka: KafkaSettings, database: DatabaseSettings) -> None:
        self._env = child_environment(kafka, database)
        self._task = asyncio.create_task(
            restarting(self._run, "the store's projector process"), name="agl-store-projector"
        )

    async def _run(self) -> None:
        process = await asyncio.create_subprocess_exec(
            *COMMAND, env=self._env, preexec_fn=die_with_parent
        )
        try:
            code = await process.wait()
        finally:
            if process.returncode is None:  # cancelled: the store is closing
                process.terminate()
                try:
                    await asyncio.wait_for(process.wait(), STOP_SECONDS)
                except TimeoutError:
                    process.kill()
                    await process.wait()
        # Stopped by a signal of its own (its process group's, an operator's): handled (0),
        # or come before its handler was installed (-SIGTERM, -SIGINT).
        if code in (0, -signal.SIGTERM, -signal.SIGINT):
            log.warning(
                "the store's projector process stopped; the store's reads of history wait for "
                "a projector (`agl-stream worker projector`)"
            )
            return
        raise RuntimeError(f"it exited with status {code}")

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
