"""`agl-stream status`."""

from __future__ import annotations

import json
from dataclasses import asdict

import click
from rich.table import Table

from agl_stream.cli.common import AppContext, console, friendly_errors, run
from agl_stream.config import KafkaSettings, StackSettings, load
from agl_stream.embedded.stack import EmbeddedStack
from agl_stream.status import StatusReport, collect


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

    Exits with 1 when the broker or the database cannot be reached or topics are missing.
    """
    kafka, database = app.kafka(), app.database()
    report = run(collect(kafka, database, embedded_broker(kafka)))
    shown = kafka.describe()  # never a password
    security = ", ".join(v for k, v in shown.items() if k in ("security protocol", "sasl"))
    if as_json:
        payload = asdict(report)
        payload["database_url"] = database.display_url()
        payload["security"] = security
        click.echo(json.dumps(payload, indent=2))
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
