"""SQLAlchemy engines that connect the way the rest of agl-stream does: with asyncpg, from
the database URL as asyncpg reads it."""

from __future__ import annotations

from typing import Any

import asyncpg
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from agl_stream.runtime.config import DatabaseSettings


def async_engine(settings: DatabaseSettings, **options: Any) -> AsyncEngine:
    """An engine whose connections asyncpg makes from the URL itself. SQLAlchemy's own URL
    handling would pass the URL's query parameters to asyncpg.connect as keywords, which
    refuses those it does not know (sslmode, sslrootcert, application_name) with a
    TypeError; asyncpg's DSN parser takes them as the projector and `status` do."""
    dsn = settings.asyncpg_dsn

    async def connect() -> asyncpg.Connection:
        return await asyncpg.connect(dsn)

    return create_async_engine("postgresql+asyncpg://", async_creator=connect, **options)
