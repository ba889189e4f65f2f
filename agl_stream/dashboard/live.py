"""Live updates for the page: server-sent events woken by the projector's commits (its
NOTIFY after each transaction), through one LISTEN connection for all the pages watching.
A burst of commits is one `changed` event at most every MIN_GAP_SECONDS per page; a page
that is slow to read gets the latest news, never a backlog (one flag per page, not a queue).
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from agl_stream.projection.notices import hold_listen
from agl_stream.runtime.config import DatabaseSettings
from agl_stream.runtime.supervision import restarting

MIN_GAP_SECONDS = 0.5
KEEPALIVE_SECONDS = 15.0


class Changes:
    def __init__(self, database: DatabaseSettings) -> None:
        self.database = database
        self._pages: set[asyncio.Event] = set()
        self._listener: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self.notifications = 0

    async def start(self) -> None:
        self._listener = asyncio.create_task(
            restarting(self._listen, "the dashboard's LISTEN connection", cap=5.0), name="listen"
        )

    def close_pages(self) -> None:
        """End every page's stream now (before the server waits for its requests to end: a
        stream would otherwise run until its next keep-alive found the page gone)."""
        self._closing.set()
        for page in self._pages:
            page.set()

    async def stop(self) -> None:
        self.close_pages()
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)

    async def _listen(self) -> None:
        """Pages are told of each commit, and of a change on reconnecting."""
        await hold_listen(self.database.asyncpg_dsn, self._wake, "the dashboard's LISTEN")

    def _wake(self) -> None:
        self.notifications += 1
        for page in self._pages:
            page.set()

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """GET /api/live: `event: changed` each time the read model changed."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        changed = asyncio.Event()
        self._pages.add(changed)
        try:
            await response.write(b"retry: 2000\n\n")
            while not self._closing.is_set():
                try:
                    await asyncio.wait_for(changed.wait(), KEEPALIVE_SECONDS)
                except TimeoutError:
                    await response.write(b": keep-alive\n\n")
                    continue
                if self._closing.is_set():
                    break
                changed.clear()
                data = json.dumps({"notifications": self.notifications})
                await response.write(f"event: changed\ndata: {data}\n\n".encode())
                await asyncio.sleep(MIN_GAP_SECONDS)
        except (ConnectionResetError, ConnectionError):
            pass  # the page went away
        finally:
            self._pages.discard(changed)
        return response
