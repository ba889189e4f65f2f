"""Create the database if it is missing and bring its schema to the newest migration."""

from __future__ import annotations

from pathlib import Path

import asyncpg
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from agl_stream.config import DatabaseSettings

MIGRATIONS = Path(__file__).parent / "migrations"


def alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


async def ensure_database(settings: DatabaseSettings) -> bool:
    """CREATE DATABASE when it does not exist; True when it was created."""
    admin = settings.with_database("postgres")
    conn = await asyncpg.connect(admin.asyncpg_dsn)
    try:
        exists = await conn.fetchval(
            "SELECT 1 FROM pg_database WHERE datname = $1", settings.database_name
        )
        if exists:
            return False
        name = settings.database_name.replace('"', '""')
        await conn.execute(f'CREATE DATABASE "{name}"')
        return True
    finally:
        await conn.close()


async def migrate(settings: DatabaseSettings) -> str | None:
    """Upgrade to head; returns the revision the database is at afterwards."""
    await ensure_database(settings)
    engine = create_async_engine(settings.sqlalchemy_url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_upgrade)
            return await conn.run_sync(_current)
    finally:
        await engine.dispose()


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


async def current_revision(settings: DatabaseSettings) -> str | None:
    engine = create_async_engine(settings.sqlalchemy_url)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(_current)
    finally:
        await engine.dispose()


def _upgrade(connection: Connection) -> None:
    config = alembic_config()
    config.attributes["connection"] = connection
    command.upgrade(config, "head")


def _current(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()
