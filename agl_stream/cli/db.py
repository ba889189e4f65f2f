"""`agl-stream db ...`: the PostgreSQL schema."""

from __future__ import annotations

import click

from agl_stream.cli.common import AppContext, console, friendly_errors, run
from agl_stream.db.migrate import current_revision, head_revision, migrate


@click.group()
def db() -> None:
    """The database schema of the read model."""


@db.command("upgrade")
@click.pass_obj
@friendly_errors
def upgrade(app: AppContext) -> None:
    """Create the database if needed and migrate it to the newest schema. Safe to run again."""
    settings = app.database()
    revision = run(migrate(settings))
    console.print(f"{settings.display_url()} is at schema revision {revision}", highlight=False)


@db.command("current")
@click.pass_obj
@friendly_errors
def current(app: AppContext) -> None:
    """Print the database's schema revision and the newest one this release knows."""
    revision = run(current_revision(app.database()))
    console.print(f"current: {revision or 'none'}  newest: {head_revision()}")
