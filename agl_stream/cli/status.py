"""`agl-stream status`."""

from __future__ import annotations

import json
from dataclasses import asdict

import click
from rich.table import Table

from agl_stream.cli.common import AppContext, console, friendly_errors, run
from agl_stream.commands.status import PartitionProjection, StatusReport, collect
from agl_stream.embedded.stack import EmbeddedStack
from agl_stream.runtime.config import KafkaSettings, StackSettings, load


def embedded_broker(kafka: KafkaSettings) -> str | None:
    """How the embedded stack names its broker, when `kafka` points at it."""
    state = EmbeddedStack(load(StackSettings)).running()
    if state is None or state.bootstrap_servers != kafka.bootstrap_servers:
        return None
    nodes = len(state.nodes)
    return f"{state.broker}, KRaft, embedded in {state.home} ({nodes} node{'s' * (nodes > 1)})"


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.pass_obj
@friendly_errors
def status(app: AppContext, as_json: bool) -> None:
    """Show the broker, topics (partitions, records), consumer groups (lag) and the database.

    Exits with 1 when the broker or the database cannot be reached, topics are missing, or
    running projectors have not moved a partition that is behind for two minutes.
    """
    kafka, database = app.kafka(), app.database()
    report = run(collect(kafka, database, embedded_broker(kafka)))
    shown = kafka.describe()  # never a password
    security = ", ".join(v for k, v in shown.items() if k in ("security protocol", "sasl"))
    if as_json:
        payload = asdict(report)
        payload["database_url"] = database.display_url()
        payload["security"] = security
        payload["stuck"] = [asdict(p) for p in report.stuck()]
        click.echo(json.dumps(payload, indent=2, default=str))
    else:
        _render(report, database.display_url(), security)
    if not report.healthy:
        raise SystemExit(1)


def _render(report: StatusReport, database_url: str, security: str = "PLAINTEXT") -> None:
    ok, bad = "[green]ok[/]", "[red]unreachable[/]"
    summary = Table(show_header=False, title="agl-stream status", title_justify="left")
    summary.add_row("broker", report.bootstrap_servers, ok if report.broker_reachable else bad)
    if security != "PLAINTEXT":
        summary.add_row("", security, "")
    if report.broker:
        summary.add_row("", report.broker, "")
    if report.database is not None:
        db = report.database
        state = ok if db.reachable else bad
        detail = db.detail
        if db.reachable:
            current = db.revision or "none"
            detail += f", schema {current}" + (
                ""
                if db.revision == db.head
                else f" (newest is {db.head}: run `agl-stream up` or migrate)"
            )
        summary.add_row("database", database_url, state)
        summary.add_row("", detail, "")
    if report.broker_detail:
        summary.add_row("", report.broker_detail, "")
    console.print(summary)
    if report.topics or report.missing_topics:
        topics = Table(title="topics", title_justify="left")
        for column in ("topic", "partitions", "records", "end offsets"):
            topics.add_column(column, justify="right" if column != "topic" else "left")
        for t in report.topics:
            ends = " ".join(str(o) for o in t.end_offsets)
            topics.add_row(t.name, str(t.partitions), str(t.records), ends)
        for name in report.missing_topics:
            topics.add_row(f"[red]{name}[/]", "missing", "", "run `agl-stream topics apply`")
        console.print(topics)
    if report.groups:
        groups = Table(title="consumer groups", title_justify="left")
        for column in ("group", "state", "members", "lag"):
            groups.add_column(column)
        for g in report.groups:
            lag = ", ".join(f"{topic}: {n}" for topic, n in sorted(g.lag.items())) or "-"
            groups.add_row(g.group, g.state, str(g.members), lag)
        console.print(groups)
    if report.projection:
        _render_projection(report)


def _render_projection(report: StatusReport) -> None:
    """Per projected topic: how far the read model is behind; then each stuck partition."""
    table = Table(title="projection (the read model)", title_justify="left")
    for column in ("topic", "projected", "records", "lag", "last moved"):
        table.add_column(column, justify="left" if column == "topic" else "right")
    by_topic: dict[str, list[PartitionProjection]] = {}
    for p in report.projection:
        by_topic.setdefault(p.topic, []).append(p)
    for topic, parts in by_topic.items():
        moved = [p.updated_at for p in parts if p.updated_at is not None]
        table.add_row(
            topic,
            str(sum(min(p.projected_to, p.end) for p in parts)),
            str(sum(p.end for p in parts)),
            str(sum(p.lag for p in parts)),
            max(moved).strftime("%Y-%m-%d %H:%M:%S") if moved else "never",
        )
    console.print(table)
    behind = sum(p.lag for p in report.projection)
    if behind and not report.projectors:
        console.print(f"{behind} records wait for a projector: none is running.")
    for p in report.stuck():
        since = "never" if p.updated_at is None else p.updated_at.strftime("%H:%M:%S")
        console.print(
            f"[red]{p.topic}[{p.partition}] is stuck[/] at offset {p.projected_to} of {p.end} "
            f"(last moved: {since}) while {report.projectors} projector(s) run: see their "
            "logs and `agl-stream dlq`."
        )
