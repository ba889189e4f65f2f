"""What a failure to use PostgreSQL means to the person who configured it, in a sentence.

asyncpg raises its own errors (and plain OSError when it cannot connect); SQLAlchemy wraps
the former in DBAPIError. Both reach the CLI from many commands, so they are explained here
once, by SQLSTATE, instead of at each place that connects.
"""

from __future__ import annotations

import traceback

import asyncpg
from sqlalchemy.exc import DBAPIError

UPGRADE = "`agl-stream db upgrade`"

# SQLSTATE -> what it means here and what to do (the server's message goes in front).
_ADVICE = {
    "3D000": f"check the database name, or run {UPGRADE}, which creates it",
    "28000": "check the user name in the URL",
    "28P01": "check the user and password in the URL",
    "42P01": f"migrate the database with {UPGRADE}",
    "3F000": f"migrate the database with {UPGRADE}",
    "42501": "the user lacks a privilege: grant it, or use the user that ran " + UPGRADE,
    "57P03": "PostgreSQL is starting or stopping: try again in a moment",
    "53300": "PostgreSQL has no connection left: close some or raise max_connections",
    "53100": "PostgreSQL's disk is full: free space or grow its volume",
}


def database_problem(exc: BaseException) -> str | None:
    """One or two sentences for an error PostgreSQL gave or that reaching it raised; None
    when `exc` did not come from PostgreSQL."""
    refused = _postgres_error(exc)
    if refused is not None:
        # (asyncpg's text adds the server's DETAIL and HINT lines: the first line says it)
        first = str(refused).strip().split("\n", 1)[0]
        message = first.rstrip(".") or type(refused).__name__
        advice = _ADVICE.get(getattr(refused, "sqlstate", "") or "")
        return f"{message}: {advice}" if advice else f"PostgreSQL refused: {message}"
    if isinstance(exc, OSError) and _raised_in_asyncpg(exc):
        if isinstance(exc, TimeoutError):
            return "PostgreSQL did not answer in time: is the host right, and is it running?"
        reason = exc.strerror or str(exc) or type(exc).__name__
        return (
            f"cannot reach PostgreSQL ({reason}): is it running (`agl-stream up` starts the "
            "embedded one), and are the host and port right?"
        )
    return None


def _postgres_error(exc: BaseException) -> asyncpg.PostgresError | None:
    if isinstance(exc, asyncpg.PostgresError):
        return exc
    if isinstance(exc, DBAPIError):
        # SQLAlchemy's asyncpg dialect raises its own error from asyncpg's.
        cause = exc.orig.__cause__ if exc.orig is not None else None
        return cause if isinstance(cause, asyncpg.PostgresError) else None
    return None


def _raised_in_asyncpg(exc: BaseException) -> bool:
    # A socket error says nothing of what was being reached: asyncpg in its traceback does
    # (the Kafka client wraps its own socket errors in KafkaConnectionError).
    return any(
        frame.f_globals.get("__name__", "").startswith("asyncpg.")
        for frame, _ in traceback.walk_tb(exc.__traceback__)
    )
