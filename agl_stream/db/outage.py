"""PostgreSQL going away and coming back, as the long-running processes see it.

A projector, the store facade and the dashboard outlive PostgreSQL's restarts: an error that
means "PostgreSQL is not there right now" (a refused or dropped connection, a server that is
starting, stopping or recovering from a crash, or out of disk, memory or connections) is
waited out, saying what waits and for how long; any other error (a wrong password, a missing
database) is the operator's to fix and still stops the process. One-shot commands keep
failing at once with database_problem's sentence.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import asyncpg
from sqlalchemy.exc import DBAPIError

from agl_stream.db.problems import database_problem
from agl_stream.runtime.causes import causes

log = logging.getLogger(__name__)
T = TypeVar("T")

# SQLSTATEs of a server that is there but cannot serve now: shutting down (57P01), crashed
# and restarting (57P02), starting or recovering (57P03); out of a resource it gets back when
# the operator or the load frees it: its disk full (53100), memory (53200), connections
# (53300), or others (53000). A write that failed on them was rolled back whole.
_TRANSIENT_STATES = frozenset({"57P01", "57P02", "57P03", "53000", "53100", "53200", "53300"})
SAY_EVERY_SECONDS = 15.0
FIRST_RETRY_SECONDS = 0.25
MAX_RETRY_SECONDS = 5.0


class DatabaseUnavailable(ConnectionError):
    """PostgreSQL cannot be reached now; what asked may try again later (HTTP 503)."""


def unavailable(exc: BaseException) -> bool:
    """Whether `exc` means PostgreSQL is away for now (rather than refusing what was asked)."""
    return any(
        _transient(error) or (isinstance(error, DBAPIError) and error.connection_invalidated)
        for error in causes(exc)
    )


def _transient(error: BaseException) -> bool:
    if isinstance(error, asyncpg.PostgresConnectionError):  # SQLSTATE class 08
        return True
    if isinstance(error, asyncpg.PostgresError):
        return getattr(error, "sqlstate", None) in _TRANSIENT_STATES
    if isinstance(error, asyncpg.InterfaceError):
        return "closed" in str(error) or "connection" in str(error)
    if isinstance(error, DatabaseUnavailable):
        return True
    # A socket that asyncpg could not open, or that broke under it.
    return isinstance(error, OSError) and database_problem(error) is not None


def reason(exc: BaseException) -> str:
    """A short reason for a log line or a 503."""
    return database_problem(exc) or str(exc) or type(exc).__name__


class Outage:
    """Says, while PostgreSQL is away, what waits for it: once when the outage starts, every
    SAY_EVERY_SECONDS while it lasts, and once when it ends (with how long it lasted)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.began: float | None = None
        self._said_at = 0.0
        self.outages = 0

    def failed(self, exc: BaseException) -> None:
        now = asyncio.get_running_loop().time()
        if self.began is None:
            self.began, self._said_at = now, now
            self.outages += 1
            log.warning(
                "PostgreSQL cannot be used now (%s): %s waits for it", reason(exc), self.what
            )
        elif now - self._said_at >= SAY_EVERY_SECONDS:
            self._said_at = now
            log.warning(
                "%s still waits for PostgreSQL (%.0f s so far): %s",
                self.what, now - self.began, reason(exc),
            )  # fmt: skip

    def back(self) -> None:
        if self.began is not None:
            lasted = asyncio.get_running_loop().time() - self.began
            log.warning("PostgreSQL answers again after %.1f s: %s goes on", lasted, self.what)
            self.began = None


async def riding_out(
    work: Callable[[], Awaitable[T]], what: str, outage: Outage | None = None
) -> T:
    """Run `work`, and again (after a jittered backoff up to MAX_RETRY_SECONDS) each time it
    fails because PostgreSQL is away; any other error passes through. `work` starts over
    whole, so it must be safe to repeat (the projector's transactions are: the database
    holds their offsets)."""
    watch = outage or Outage(what)
    delay = FIRST_RETRY_SECONDS
    while True:
        try:
            result = await work()
        except Exception as exc:
            if not unavailable(exc):
                raise
            watch.failed(exc)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, MAX_RETRY_SECONDS)
            continue
        watch.back()
        return result


async def reachable(dsn: str, what: str, outage: Outage | None = None) -> None:
    """Return once PostgreSQL at `dsn` answers (`SELECT 1`), waiting out an outage."""

    async def ping() -> None:
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            await conn.fetchval("SELECT 1")
        finally:
            await conn.close()

    await riding_out(ping, what, outage)
