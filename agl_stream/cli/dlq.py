"""`agl-stream dlq ...`: what was dead-lettered and why."""

from __future__ import annotations

import click
from rich.table import Table

from agl_stream.cli.common import AppContext, console, friendly_errors, run
from agl_stream.queries.dead_letters import read_dead_letters


@click.group()
def dlq() -> None:
    """The dead-letter topic."""


@dlq.command("list")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(min=1))
@click.pass_obj
@friendly_errors
def list_dead_letters(app: AppContext, limit: int) -> None:
    """Show the newest dead letters: where each came from and why it was rejected."""
    letters = run(read_dead_letters(app.kafka(), limit))
    table = Table(title=f"dead letters ({len(letters)})", title_justify="left")
    for column in ("offset", "source", "kind", "reason", "consumer", "at"):
        table.add_column(column)
    for letter in letters:
        source = f"{letter.source_topic}[{letter.source_partition}]@{letter.source_offset}"
        table.add_row(
            str(letter.dlq_offset), source, letter.kind, letter.reason, letter.consumer, letter.at
        )
    console.print(table)
