"""`agl-stream topics ...`."""

from __future__ import annotations

import click
from rich.table import Table

from agl_stream.bus.topic_admin import apply_topics, ensure_topics_ready
from agl_stream.bus.topic_spec import load_topic_specs
from agl_stream.cli.common import AppContext, console, friendly_errors, run


@click.group()
def topics() -> None:
    """Topic definitions (topics/*.toml) and the broker's topics."""


@topics.command("list")
@click.pass_obj
@friendly_errors
def list_topics(app: AppContext) -> None:
    """List the topic definitions: partitions, cleanup, retention and the events each carries."""
    prefix = app.kafka().topic_prefix
    table = Table(title="topic definitions", title_justify="left")
    for column in ("topic", "partitions", "cleanup", "retention", "compression", "key", "events"):
        table.add_column(column)
    for spec in load_topic_specs().values():
        retention = "forever" if spec.retention_ms < 0 else f"{spec.retention_ms / 86_400_000:g} d"
        table.add_row(
            spec.full_name(prefix), str(spec.partitions), spec.cleanup_policy, retention,
            spec.compression, spec.key, ", ".join(spec.events) or "(raw dead letters)",
        )  # fmt: skip
    console.print(table)


@topics.command("apply")
@click.pass_obj
@friendly_errors
def apply(app: AppContext) -> None:
    """Create missing topics and correct their configs. Safe to run again.

    Drift that cannot be fixed in place (a different partition count) is reported and makes
    the command exit with 1.
    """
    report = run(apply_topics(app.kafka()))
    table = Table(title="topics apply", title_justify="left")
    table.add_column("topic")
    table.add_column("result")
    for name in report.created:
        table.add_row(name, "[green]created[/]")
    for drift in report.altered:
        table.add_row(
            drift.topic, f"[yellow]fixed[/] {drift.setting}: {drift.actual} -> {drift.expected}"
        )
    for name in report.in_sync:
        table.add_row(name, "in sync")
    for drift in report.unfixed:
        table.add_row(
            drift.topic,
            f"[red]drift[/] {drift.setting} is {drift.actual}, expected {drift.expected}",
        )
    console.print(table)
    if report.unfixed:
        raise SystemExit(1)


@topics.command("check")
@click.argument("names", nargs=-1)
@click.pass_obj
@friendly_errors
def check(app: AppContext, names: tuple[str, ...]) -> None:
    """Check that topics exist as defined (what workers check at start). Exits 1 if not.

    NAMES are short topic names (tasks, spans, ...); all topics when none are given.
    """
    specs = load_topic_specs()
    unknown = sorted(set(names) - set(specs))
    if unknown:
        raise click.BadParameter(
            f"unknown topics {unknown}; defined: {sorted(specs)}", param_hint="NAMES"
        )
    run(ensure_topics_ready(app.kafka(), names or tuple(specs)))
    console.print("topics ready")
