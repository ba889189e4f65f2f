"""`agl-stream replay`: rebuild the read model from the topics."""

from __future__ import annotations

from datetime import datetime

import click
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from agl_stream.cli.common import AppContext, console, friendly_errors, parse_offsets, run
from agl_stream.cli.times import TIME
from agl_stream.db.migrate import check_schema_name
from agl_stream.projection.projector import PROJECTED_TOPICS
from agl_stream.projection.replay import ReplayLimits, replay


def _offsets(app: AppContext, values: tuple[str, ...]) -> dict[tuple[str, int], int]:
    prefix = app.kafka().topic_prefix
    short = parse_offsets(values, "--until-offset", prefix, PROJECTED_TOPICS, "the projector")
    return {(prefix + topic, partition): offset for (topic, partition), offset in short.items()}


@click.command("replay")
@click.option("--name", help="Name of the new read model. [default: read_model_N]")
@click.option("--until-time", type=TIME, help="Stop at records written after this time.")
@click.option(
    "--until-offset",
    multiple=True,
    metavar="TOPIC:PARTITION=OFFSET",
    help="Stop that partition before this offset. Repeatable.",
)
@click.option(
    "--switch/--no-switch",
    default=None,
    help="Make it the read model queries read when caught up. "
    "[default: switch, unless --until-* asks for the past]",
)
@click.pass_obj
@friendly_errors
def replay_command(
    app: AppContext,
    name: str | None,
    until_time: datetime | None,
    until_offset: tuple[str, ...],
    switch: bool | None,
) -> None:
    """Rebuild the read model from the topics into a fresh schema.

    Queries keep reading the current read model meanwhile; when the new one has caught up
    it becomes the active one, and running projectors follow it. With --until-time or
    --until-offset it shows the state as it was then: query it with --read-model NAME.
    """
    if name is not None:
        try:
            check_schema_name(name)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--name") from None
    limits = ReplayLimits(until_time=until_time, until_offsets=_offsets(app, until_offset))
    columns = (
        TextColumn("replaying"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TimeRemainingColumn(),
    )  # fmt: skip
    with Progress(*columns, console=console, transient=True) as progress:
        bar = progress.add_task("replay", total=None)

        def report(done: int, total: int) -> None:
            progress.update(bar, completed=done, total=total)

        try:
            result = run(replay(app.kafka(), app.database(), name, limits, switch, report))
        except ValueError as exc:  # a read model of that name exists
            raise click.BadParameter(str(exc), param_hint="--name") from None
    state = "active: queries read it now" if result.switched else "not active"
    console.print(
        f"read model {result.name}: {result.events} events projected, "
        f"{result.dead_letters} undecodable records skipped; {state}",
        highlight=False,
    )
