"""Create the database if it is missing and bring its schema to the newest migration."""

from __future__ import annotations

import re
from pathlib import Path

import asyncpg
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import Connection

from agl_stream.db.engine import async_engine
from agl_stream.runtime.config import DatabaseSettings

MIGRATIONS = Path(__file__).parent / "migrations"
READ_MODEL_MIGRATIONS = Path(__file__).parent / "read_model"
FIRST_READ_MODEL = "read_model_1"
_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def alembic_config(location: Path = MIGRATIONS) -> Config:
    config = Config()
    config.set_main_option("script_location", str(location))
    return config


def check_schema_name(name: str) -> str:
    """A read model's PostgreSQL schema name: lowercase letters, digits, underscores."""
    # PostgreSQL keeps pg_* for its own schemas and refuses to create one.
    if (
        not _SCHEMA_NAME.match(name)
        or name.startswith("pg_")
        or name in {"public", "information_schema"}
    ):
        shown = repr(name if len(name) <= 70 else f"{name[:70]}...")
        raise ValueError(
            f"{shown} cannot name a read model: use lowercase letters, digits and "
            "underscores, starting with a letter (at most 63), not starting with pg_, and "
            "not 'public' or 'information_schema'"
        )
    return name


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
    """Upgrade the control tables and every read model to head, creating the first read
    model when there is none; returns the control revision afterwards."""
    await ensure_database(settings)
    engine = async_engine(settings)
    try:
        async with engine.begin() as conn:
            # One migrator at a time (several workers may start together).
            await conn.execute(text("SELECT pg_advisory_xact_lock(7305111)"))
            await conn.run_sync(_upgrade)
            names = (
                (await conn.execute(text("SELECT name FROM read_models WHERE state <> 'retired'")))
                .scalars()
                .all()
            )
            if not names:
                await conn.execute(
                    text(
                        "INSERT INTO read_models (name, active, state, activated_at, description)"
                        " VALUES (:name, true, 'active', now(), 'created by migrate')"
                    ),
                    {"name": FIRST_READ_MODEL},
                )
                names = [FIRST_READ_MODEL]
            for name in names:
                await conn.run_sync(_upgrade_read_model, name)
            return await conn.run_sync(_current)
    finally:
        await engine.dispose()


async def create_read_model(settings: DatabaseSettings, name: str, description: str) -> None:
    """A new, empty read model schema at head, registered as 'building' (not active)."""
    check_schema_name(name)
    engine = async_engine(settings)
    try:
        async with engine.begin() as conn:
            exists = await conn.execute(
                text("SELECT 1 FROM read_models WHERE name = :name"), {"name": name}
            )
            if exists.first() is not None:
                raise ValueError(f"a read model named {name!r} exists already")
            taken = await conn.execute(
                text("SELECT 1 FROM pg_namespace WHERE nspname = :name"), {"name": name}
            )
            if taken.first() is not None:  # a read model's schema would mix into it
                raise ValueError(
                    f"the database has a schema named {name!r} that is not a read model; "
                    "choose another name"
                )
            await conn.execute(
                text(
                    "INSERT INTO read_models (name, state, description) "
                    "VALUES (:name, 'building', :description)"
                ),
                {"name": name, "description": description},
            )
            await conn.run_sync(_upgrade_read_model, name)
    finally:
        await engine.dispose()


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


async def current_revision(settings: DatabaseSettings) -> str | None:
    engine = async_engine(settings)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(_current)
    finally:
        await engine.dispose()


def _upgrade(connection: Connection) -> None:
    config = alembic_config()
    config.attributes["connection"] = connection
    command.upgrade(config, "head")


def _upgrade_read_model(connection: Connection, schema: str) -> None:
    connection.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{check_schema_name(schema)}"'))
    config = alembic_config(READ_MODEL_MIGRATIONS)
    config.attributes["connection"] = connection
    config.attributes["schema"] = schema
    command.upgrade(config, "head")
    connection.execute(text("SET LOCAL search_path TO public"))


def _current(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()
