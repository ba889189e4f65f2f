"""Which errors mean PostgreSQL is away for now (waited out) and which are the operator's to
fix (they still stop the process)."""

from __future__ import annotations

import asyncio
import logging

import asyncpg
import pytest
from sqlalchemy.exc import DBAPIError

from agl_stream.db.outage import DatabaseUnavailable, Outage, reason, riding_out, unavailable


def _from_asyncpg(exc: OSError) -> OSError:
    """A socket error raised from a frame of asyncpg's (database_problem looks at the
    traceback's modules)."""
    try:
        exec("raise exc", {"__name__": "asyncpg.connect_utils", "exc": exc})
    except OSError as raised:
        return raised
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    "exc",
    [
        asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
        asyncpg.exceptions.CannotConnectNowError("the database system is starting up"),
        asyncpg.exceptions.AdminShutdownError("terminating connection due to administrator"),
        asyncpg.exceptions.CrashShutdownError("terminating connection: crash of another"),
        asyncpg.exceptions.TooManyConnectionsError("sorry, too many clients already"),
        asyncpg.exceptions.DiskFullError("could not extend file: No space left on device"),
        asyncpg.InterfaceError("connection is closed"),
        DatabaseUnavailable("the read model is out of reach"),
    ],
    ids=type,
)
def test_a_server_away_or_restarting_is_waited_out(exc: BaseException) -> None:
    assert unavailable(exc)


def test_a_refused_socket_counts_only_when_asyncpg_raised_it() -> None:
    assert unavailable(_from_asyncpg(ConnectionRefusedError(111, "Connection refused")))
    assert not unavailable(ConnectionRefusedError(111, "Connection refused"))


def test_the_cause_is_looked_through() -> None:
    wrapped = RuntimeError("a query failed")
    wrapped.__cause__ = asyncpg.ConnectionDoesNotExistError("closed")
    assert unavailable(wrapped)
    invalidated = DBAPIError("SELECT 1", None, Exception("gone"), connection_invalidated=True)
    assert unavailable(invalidated)


@pytest.mark.parametrize(
    "exc",
    [
        asyncpg.InvalidPasswordError("password authentication failed"),
        asyncpg.InvalidCatalogNameError('database "nope" does not exist'),
        asyncpg.UndefinedTableError('relation "rollouts" does not exist'),
        asyncpg.exceptions.QueryCanceledError("canceling statement due to statement timeout"),
        ValueError("a bad argument"),
    ],
    ids=type,
)
def test_what_the_operator_must_fix_is_not(exc: BaseException) -> None:
    assert not unavailable(exc)


async def test_riding_out_retries_an_outage_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    calls = 0

    async def work() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise asyncpg.exceptions.CannotConnectNowError("the database system is starting up")
        return "done"

    outage = Outage("the test")
    with caplog.at_level(logging.WARNING):
        assert await riding_out(work, "the test", outage) == "done"
    assert calls == 3 and outage.outages == 1 and outage.began is None
    text = caplog.text
    assert "PostgreSQL cannot be used now" in text and "the test waits for it" in text
    assert "PostgreSQL answers again after" in text


async def test_riding_out_passes_other_errors_on_at_once() -> None:
    async def work() -> None:
        raise asyncpg.InvalidPasswordError("password authentication failed")

    with pytest.raises(asyncpg.InvalidPasswordError):
        await asyncio.wait_for(riding_out(work, "the test"), 5)


def test_a_full_disk_is_said_in_one_line_with_what_to_do() -> None:
    full = asyncpg.exceptions.DiskFullError('could not extend file "base/1/2": No space left')
    full.hint = "Check free disk space."  # (asyncpg adds the server's hint as a second line)
    assert reason(full) == (
        'could not extend file "base/1/2": No space left: PostgreSQL\'s disk is full: free '
        "space or grow its volume"
    )
