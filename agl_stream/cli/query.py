"""`agl-stream query ...`: what happened, from the read model, as tables or JSON."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine, Sequence
from datetime import datetime
from typing import Any, TypeVar

import click
from aiokafka.errors import KafkaError
from pydantic import BaseModel
from rich.table import Table

from agl_stream.bus.kafka import end_offsets
from agl_stream.bus.streams import Topics
from agl_stream.cli.common import (
    AppContext,
    console,
    friendly_errors,
    metadata_filter,
    read_model_option,
    run,
)
from agl_stream.cli.times import TIME
from agl_stream.projection.replay import list_read_models, projected_partitions
from agl_stream.queries import PartitionLag, ReadModel
from agl_stream.queries.params import MODES, ROLLOUT_STATUSES, SORTS, RolloutFilter

T = TypeVar("T")


_read_model_option = read_model_option("Read")


def _json_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")(f)


def _ask(
    app: AppContext, read_model: str | None, question: Callable[[ReadModel], Coroutine[Any, Any, T]]
) -> T:
    async def go() -> T:
        async with ReadModel.open(app.database(), read_model) as rm:
            return await question(rm)

    return run(go())


def _print_json(value: BaseModel | Sequence[BaseModel] | dict[str, Any]) -> None:
    if isinstance(value, BaseModel):
        data: Any = value.model_dump(mode="json")
    elif isinstance(value, dict):
        data = value
    else:
        data = [v.model_dump(mode="json") for v in value]
    click.echo(json.dumps(data, indent=2))


def _t(value: datetime | None) -> str:
    return "" if value is None else value.strftime("%Y-%m-%d %H:%M:%S")


def _n(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def _table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*row)
    console.print(table)


@click.group()
def query() -> None:
    """Ask the read model what happened (a projector keeps it up to date)."""


@query.command()
@click.option("--status", multiple=True, type=click.Choice(ROLLOUT_STATUSES), help="Repeatable.")
@click.option("--mode", multiple=True, type=click.Choice(MODES), help="Repeatable.")
@click.option("--since", type=TIME, help="From this time (ISO 8601, or an age: 1h, 7d).")
@click.option("--until", type=TIME, help="Before this time.")
@click.option(
    "--time-field",
    type=click.Choice(["queued", "updated", "finished"]),
    default="updated",
    show_default=True,
    help="Which time --since/--until look at.",
)
@click.option("--worker", "worker_id", help="Rollouts whose latest attempt ran on this worker.")
@click.option("--resources-id", help="Pinned to, or last run with, these resources.")
@click.option("--metadata", multiple=True, metavar="KEY[=VALUE]", help="Repeatable.")
@click.option("--sort", type=click.Choice(SORTS), default="queued", show_default=True)
@click.option("--desc", "descending", is_flag=True, help="Newest (or highest) first.")
@click.option("--limit", type=int, default=50, show_default=True, help="Rows per page (1-1000).")
@click.option("--cursor", help="The next-page cursor a previous page printed.")
@_read_model_option
@_json_option
@click.pass_obj
@friendly_errors
def rollouts(
    app: AppContext,
    status: tuple[str, ...],
    mode: tuple[str, ...],
    since: datetime | None,
    until: datetime | None,
    time_field: str,
    worker_id: str | None,
    resources_id: str | None,
    metadata: tuple[str, ...],
    sort: str,
    descending: bool,
    limit: int,
    cursor: str | None,
    read_model: str | None,
    as_json: bool,
) -> None:
    """Rollouts, filtered and sorted, one page at a time.

    Example: which rollouts failed in the last hour, and why:

        agl-stream query rollouts --status failed --since 1h --time-field finished
    """
    f = RolloutFilter.of(
        status=status, mode=mode, since=since, until=until, time_field=time_field,
        worker_id=worker_id, resources_id=resources_id, metadata=metadata_filter(metadata),
        sort=sort, descending=descending, limit=limit, cursor=cursor,
    )  # fmt: skip
    page = _ask(app, read_model, lambda rm: rm.rollouts(f))
    if as_json:
        _print_json(page)
        return
    _table(
        f"rollouts ({len(page.items)})",
        ("rollout", "status", "mode", "attempts", "worker", "reward", "queued", "updated", "error"),
        [
            (
                r.rollout_id,
                r.status,
                r.mode or "",
                str(r.attempt_count),
                r.worker_id or "",
                _n(r.reward),
                _t(r.first_queued_at),
                _t(r.updated_at),
                "" if r.error is None else f"{r.error.get('type')}: {r.error.get('message')}",
            )
            for r in page.items
        ],
    )
    if page.next_cursor:
        console.print(f"next page: --cursor {page.next_cursor}", highlight=False)


@query.command()
@click.argument("rollout_id")
@_read_model_option
@_json_option
@click.pass_obj
@friendly_errors
def attempts(app: AppContext, rollout_id: str, read_model: str | None, as_json: bool) -> None:
    """The attempts of a rollout, oldest first, with the rewards given to them later (the
    latest of each name, the attempt's own before its rollout's)."""
    found = _ask(app, read_model, lambda rm: rm.attempts(rollout_id))
    if as_json:
        _print_json(found)
        return
    given = _ask(app, read_model, lambda rm: rm.rewards(rollout_id))

    def late(attempt_id: str) -> str:
        latest: dict[str, float] = {}
        for r in sorted(given, key=lambda r: r.attempt_id is None):  # newest first within
            if r.attempt_id in (None, attempt_id):
                latest.setdefault(r.name, r.value)
        return " ".join(f"{name}={_n(value)}" for name, value in sorted(latest.items()))

    _table(
        f"attempts of {rollout_id}",
        ("#", "attempt", "status", "worker", "resources", "spans", "reward", "late rewards",
         "started", "error"),
        [
            (
                str(a.attempt_number),
                a.attempt_id,
                a.status,
                a.worker_id,
                a.resources_id or "",
                f"{a.spans_received}/{'' if a.span_count is None else a.span_count}",
                _n(a.reward),
                late(a.attempt_id),
                _t(a.started_at),
                "" if a.error is None else f"{a.error.get('type')}: {a.error.get('message')}",
            )
            for a in found
        ],
    )  # fmt: skip


@query.command()
@click.argument("rollout_id")
@click.option("--attempt", "attempt_id", help="Only this attempt.")
@click.option("--latest", "latest_attempt", is_flag=True, help="Only the latest attempt.")
@click.option("--name", help="Only spans with this name.")
@click.option("--since", type=TIME, help="Spans that started from this time.")
@click.option("--until", type=TIME, help="Spans that started before this time.")
@click.option("--limit", type=int, default=1000, show_default=True)
@_read_model_option
@_json_option
@click.pass_obj
@friendly_errors
def spans(
    app: AppContext,
    rollout_id: str,
    attempt_id: str | None,
    latest_attempt: bool,
    name: str | None,
    since: datetime | None,
    until: datetime | None,
    limit: int,
    read_model: str | None,
    as_json: bool,
) -> None:
    """The spans of a rollout (rewards, messages and LLM calls are spans)."""
    found = _ask(
        app,
        read_model,
        lambda rm: rm.spans(
            rollout_id,
            attempt_id=attempt_id,
            latest_attempt=latest_attempt,
            name=name,
            since=since,
            until=until,
            limit=limit,
        ),
    )
    if as_json:
        _print_json(found)
        return
    _table(
        f"spans of {rollout_id} ({len(found)})",
        ("attempt", "seq", "name", "status", "start", "ms", "attributes"),
        [
            (
                s.attempt_id,
                str(s.sequence),
                s.name,
                s.status_code,
                _t(s.start_time),
                f"{(s.end_time - s.start_time).total_seconds() * 1000:.1f}",
                json.dumps(s.attributes)[:200],
            )
            for s in found
        ],
    )


@query.command()
@click.argument("rollout_id", required=False)
@click.option("--attempt", "attempt_id", help="Only rewards for this attempt.")
@click.option("--name", help="Only rewards of this name.")
@click.option("--since", type=TIME, help="Given from this time (ISO 8601, or an age: 1h, 7d).")
@click.option("--until", type=TIME, help="Given before this time.")
@click.option("--limit", type=int, default=1000, show_default=True)
@_read_model_option
@_json_option
@click.pass_obj
@friendly_errors
def rewards(
    app: AppContext,
    rollout_id: str | None,
    attempt_id: str | None,
    name: str | None,
    since: datetime | None,
    until: datetime | None,
    limit: int,
    read_model: str | None,
    as_json: bool,
) -> None:
    """Rewards given from outside attempts (`agl-stream reward`, the HTTP endpoint, other
    systems), of one rollout or of all, newest first."""
    found = _ask(
        app,
        read_model,
        lambda rm: rm.rewards(
            rollout_id, attempt_id=attempt_id, name=name, since=since, until=until, limit=limit
        ),
    )
    if as_json:
        _print_json(found)
        return
    _table(
        f"rewards{' of ' + rollout_id if rollout_id else ''} ({len(found)})",
        ("rollout", "attempt", "call", "name", "value", "source", "given"),
        [
            (
                r.rollout_id,
                r.attempt_id or "-",
                r.span_id or "-",
                r.name,
                _n(r.value),
                r.source or "-",
                _t(r.given_at),
            )
            for r in found
        ],
    )


@query.command()
@click.option("--name", help="Only versions holding this resource (e.g. a prompt template).")
@click.option("--policy", metavar="NAME", help="Only the versions this policy's trainer published.")
@click.option("--latest", is_flag=True, help="Only the latest version.")
@click.option("--limit", type=int, default=50, show_default=True)
@_read_model_option
@_json_option
@click.pass_obj
@friendly_errors
def resources(
    app: AppContext,
    name: str | None,
    policy: str | None,
    latest: bool,
    limit: int,
    read_model: str | None,
    as_json: bool,
) -> None:
    """Resources versions, newest first: the history of prompts, endpoints and checkpoints."""
    if latest:
        found = [_ask(app, read_model, lambda rm: rm.latest_resources())]
    else:
        found = _ask(
            app, read_model,
            lambda rm: rm.resources_history(name=name, limit=limit, policy=policy),
        )  # fmt: skip
    if as_json:
        _print_json(found)
        return

    def show(resources: dict[str, Any]) -> str:
        parts = []
        for key, value in resources.items():
            if name is not None and key != name:
                continue
            detail = value.get("template") or value.get("model") or value.get("uri") or ""
            parts.append(f"{key} ({value.get('type')}): {str(detail)[:80]}")
        return "\n".join(parts)

    _table(
        "resources",
        ("resources id", "version", "published", "by", "resources"),
        [
            (
                r.resources_id,
                str(r.version),
                _t(r.published_at),
                r.published_by or "",
                show(r.resources),
            )
            for r in found
        ],
    )


@query.command()
@click.option("--role", type=click.Choice(["runner", "projector", "trainer", "other"]))
@_read_model_option
@_json_option
@click.pass_obj
@friendly_errors
def workers(app: AppContext, role: str | None, read_model: str | None, as_json: bool) -> None:
    """Workers and their health (stale: no heartbeat for three intervals)."""
    found = _ask(app, read_model, lambda rm: rm.workers(role=role))
    if as_json:
        _print_json(found)
        return
    colour = {"alive": "green", "stale": "red", "stopped": "dim"}
    _table(
        "workers",
        (
            "worker",
            "role",
            "health",
            "status",
            "host",
            "pid",
            "running",
            "last heartbeat",
            "counts",
        ),
        [
            (
                w.worker_id,
                w.role,
                f"[{colour[w.health]}]{w.health}[/]",
                w.status,
                w.hostname,
                str(w.pid),
                str(len(w.current_rollouts)),
                _t(w.last_heartbeat_at),
                " ".join(f"{k}={v}" for k, v in sorted(w.counts.items())),
            )
            for w in found
        ],
    )


@query.command()
@click.argument("rollout_ids", nargs=-1, required=True)
@click.option("--timeout", type=click.FloatRange(0), default=300, show_default=True)
@_read_model_option
@_json_option
@click.pass_obj
@friendly_errors
def wait(
    app: AppContext,
    rollout_ids: tuple[str, ...],
    timeout: float,
    read_model: str | None,
    as_json: bool,
) -> None:
    """Wait until the rollouts have finished; exits 1 if some have not within --timeout."""
    statuses = _ask(app, read_model, lambda rm: rm.wait_for_rollouts(rollout_ids, within=timeout))
    if as_json:
        _print_json(statuses)
        return
    _table("finished", ("rollout", "status"), sorted(statuses.items()))


@query.command()
@_read_model_option
@_json_option
@click.pass_obj
@friendly_errors
def lag(app: AppContext, read_model: str | None, as_json: bool) -> None:
    """How far the projection is behind each partition (against the topics' ends now)."""

    async def ask(rm: ReadModel) -> list[PartitionLag]:
        kafka = app.kafka()
        try:
            tps = await asyncio.wait_for(projected_partitions(kafka, Topics(kafka)), 10)
            ends = await asyncio.wait_for(end_offsets(kafka, tps), 10)
        except (KafkaError, OSError, TimeoutError):
            return await rm.lag()  # the broker is away: the ends the projector last saw
        return await rm.lag({(tp.topic, tp.partition): end for tp, end in ends.items()})

    found = _ask(app, read_model, ask)
    if as_json:
        _print_json(found)
        return
    _table(
        f"projection lag (total {sum(p.lag for p in found)})",
        ("topic", "partition", "projected to", "end", "lag", "updated"),
        [
            (
                p.topic,
                str(p.partition),
                str(p.next_offset),
                str(p.end_offset),
                str(p.lag),
                _t(p.updated_at),
            )
            for p in found
        ],
    )


@query.command("read-models")
@_json_option
@click.pass_obj
@friendly_errors
def read_models(app: AppContext, as_json: bool) -> None:
    """The read models in the database; queries read the active one."""
    found = run(list_read_models(app.database()))
    if as_json:
        _print_json({"read_models": found})
        return
    _table(
        "read models",
        ("name", "active", "state", "created", "description"),
        [
            (
                r["name"],
                "yes" if r["active"] else "",
                r["state"],
                str(r["created_at"])[:19],
                r["description"] or "",
            )
            for r in found
        ],
    )
