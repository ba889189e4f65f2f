"""Hearing the projector's commits: it NOTIFYs NOTIFY_CHANNEL after each transaction."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import asyncpg

from agl_stream.projection.store import NOTIFY_CHANNEL


async def hold_listen(dsn: str, on_commit: Callable[[], None], what: str) -> None:
    """Hold one LISTEN connection, calling `on_commit` at each commit, until PostgreSQL drops
    it (then it raises, for `restarting` to open another). `on_commit` is also called once
    connected: commits may have gone unheard while no connection listened."""
    lost = asyncio.Event()
    conn = await asyncpg.connect(dsn)
    try:
        conn.add_termination_listener(lambda _: lost.set())
        await conn.add_listener(NOTIFY_CHANNEL, lambda *_: on_commit())
        on_commit()
        await lost.wait()
        raise ConnectionError(f"{what} to PostgreSQL was lost")
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(conn.close(), 5)
