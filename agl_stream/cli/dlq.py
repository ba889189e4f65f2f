"""`agl-stream dlq ...`: what was dead-lettered and why."""

from __future__ import annotations

import click
from aiokafka import TopicPartition
from rich.table import Table

from agl_stream.cli.common import AppContext, console, friendly_errors, run
from agl_stream.config import KafkaSettings
from agl_stream.dead_letters import DeadLetterView
from agl_stream.kafka import end_offsets
from agl_stream.streams import read_records


async def read_dead_letters(settings: KafkaSettings, limit: int) -> list[DeadLetterView]:
    """The newest `limit` dead letters, oldest first."""
    topic = settings.topic("dlq")
    tp = TopicPartition(topic, 0)
    ends = await end_offsets(settings, [tp])
    return [
        DeadLetterView.parse(record.headers or (), record.value, record.offset)
        async for record in read_records(settings, {tp: max(ends[tp] - limit, 0)}, ends)
    ]


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
