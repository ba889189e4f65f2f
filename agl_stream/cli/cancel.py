"""`agl-stream cancel`."""

from __future__ import annotations

import getpass
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

import asyncpg
import click
from rich.console import Console
from rich.table import Table
from sqlalchemy.exc import DBAPIError

from agl_stream.cli.common import (
    AppContext,
    console,
    database_error,
    err_console,
    fail,
    friendly_errors,
    metadata_filter,
    read_model_option,
    run,
)
from agl_stream.cli.times import TIME
from agl_stream.commands.cancel import (
    OPEN_STATUSES,
    CancelError,
    Selection,
    cancel,
    select_by_filter,
    select_by_id,
)
from agl_stream.queries import ReadModel, Rollout
from agl_stream.queries.params import MODES, RolloutFilter


@dataclass
class _Chosen:
    open: list[Rollout] = field(default_factory=list)
    finished: list[Rollout] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)  # ids taken as given (--force)

    @property
    def ids(self) -> list[str]:
        return [r.rollout_id for r in self.open] + self.unchecked


@click.command("cancel")
@click.argument("rollout_ids", nargs=-1, metavar="[ROLLOUT_ID]...")
@click.option(
    "--status",
    multiple=True,
    type=click.Choice(OPEN_STATUSES),
    help="Repeatable. [default: any of them]",
)
@click.option("--mode", multiple=True, type=click.Choice(MODES), help="Repeatable.")
@click.option("--since", type=TIME, help="From this time (ISO 8601, or an age: 1h, 7d).")
@click.option("--until", type=TIME, help="Before this time.")
@click.option(
    "--time-field",
    type=click.Choice(["queued", "updated"]),
    default="queued",
    show_default=True,
    help="Which time --since/--until look at.",
)
@click.option("--worker", "worker_id", help="Rollouts whose latest attempt runs on this worker.")
@click.option("--resources-id", help="Pinned to, or last run with, these resources.")
@click.option("--metadata", multiple=True, metavar="KEY[=VALUE]", help="Repeatable.")
@click.option("--reason", help="Why; the cancelled rollout's error says it.")
@click.option("--requested-by", metavar="NAME", help="Who asks. [default: USER@HOST]")
@click.option(
    "--force",
    is_flag=True,
    help="Cancel the ids as given, without looking them up in the read model.",
)
@click.option("--dry-run", is_flag=True, help="Show what would be cancelled; cancel nothing.")
@click.option(
    "--print-ids",
    is_flag=True,
    help="Print the ids cancelled (with --dry-run: those it would cancel), one per line.",
)
@read_model_option("Look rollouts up in")
@click.pass_obj
@friendly_errors
def cancel_command(
    app: AppContext,
    rollout_ids: tuple[str, ...],
    status: tuple[str, ...],
    mode: tuple[str, ...],
    since: datetime | None,
    until: datetime | None,
    time_field: str,
    worker_id: str | None,
    resources_id: str | None,
    metadata: tuple[str, ...],
    reason: str | None,
    requested_by: str | None,
    force: bool,
    dry_run: bool,
    print_ids: bool,
    read_model: str | None,
) -> None:
    """Stop rollouts: those named by ROLLOUT_ID, or every unfinished one a filter matches.

    A queued rollout finishes `cancelled` without running; a running attempt is stopped.
    Ids are looked up in the read model first: if it lacks some (never queued, or not
    projected yet) nothing is cancelled and the command exits 1, unless --force. Rollouts
    already finished are left as they are.

    \b
    Examples:
        agl-stream cancel ro-1 ro-2 --reason "wrong prompt"
        agl-stream cancel --status queuing --metadata batch=7 --dry-run
    """
    has_filter = any((status, mode, since, until, worker_id, resources_id, metadata))
    if not rollout_ids and not has_filter:
        raise click.UsageError(
            "say which rollouts to cancel: give rollout ids, or a filter such as "
            "--status queuing or --metadata KEY=VALUE"
        )
    if rollout_ids and has_filter:
        raise click.UsageError("give rollout ids or a filter, not both")
    if force and not rollout_ids:
        raise click.UsageError("--force goes with rollout ids; a filter is always looked up")
    if force:
        chosen = _Chosen(unchecked=list(dict.fromkeys(rollout_ids)))
    else:
        f = RolloutFilter.of(
            status=status, mode=mode, since=since, until=until, time_field=time_field,
            worker_id=worker_id, resources_id=resources_id, metadata=metadata_filter(metadata),
        )  # fmt: skip
        chosen = _choose(app, read_model, rollout_ids, f)
    _show(chosen, dry_run and not print_ids, err_console if print_ids else console)
    if dry_run and print_ids:
        click.echo("\n".join(chosen.ids))
    if dry_run or not chosen.ids:
        return
    try:
        ids = run(cancel(app.kafka(), chosen.ids, reason, requested_by or _who()))
    except CancelError as exc:
        raise click.UsageError(str(exc)) from None
    if print_ids:
        click.echo("\n".join(ids))
    else:
        console.print(
            f"asked to cancel {len(ids)} rollouts on {app.kafka().topic('tasks')}; "
            "`agl-stream query wait ID...` waits until they have ended",
            highlight=False,
        )


def _choose(
    app: AppContext, read_model: str | None, rollout_ids: Sequence[str], f: RolloutFilter
) -> _Chosen:
    async def ask() -> Selection | list[Rollout]:
        async with ReadModel.open(app.database(), read_model) as rm:
            if rollout_ids:
                return await select_by_id(rm, rollout_ids)
            return await select_by_filter(rm, f)

    try:
        found = run(ask())
    except CancelError as exc:
        raise click.UsageError(str(exc)) from None
    except (OSError, asyncpg.PostgresError, DBAPIError) as exc:
        problem = database_error(exc)
        if problem is None:
            raise
        hint = " (--force cancels the ids without looking them up)" if rollout_ids else ""
        fail(f"{problem}{hint}")
    if isinstance(found, list):
        return _Chosen(open=found)
    if found.unknown:
        fail(
            f"the read model has no rollout {', '.join(map(repr, found.unknown))} (never "
            "queued, or queued so recently that the projector has not caught up); nothing "
            "was cancelled. --force cancels the ids without looking them up"
        )
    return _Chosen(open=found.open, finished=found.finished)


def _show(chosen: _Chosen, table: bool, notes: Console) -> None:
    if chosen.finished:
        notes.print(
            "already finished, left as they are: "
            + ", ".join(f"{r.rollout_id} ({r.status})" for r in chosen.finished),
            highlight=False,
        )
    if not chosen.ids:
        notes.print("nothing to cancel", highlight=False)
        return
    if not table:
        return
    rows = Table(title=f"would cancel ({len(chosen.ids)})", title_justify="left")
    for column in ("rollout", "status", "mode", "attempts", "worker", "queued"):
        rows.add_column(column, overflow="fold")
    for r in chosen.open:
        queued = "" if r.first_queued_at is None else f"{r.first_queued_at:%Y-%m-%d %H:%M:%S}"
        rows.add_row(
            r.rollout_id, r.status, r.mode or "", str(r.attempt_count), r.worker_id or "", queued
        )
    for rollout_id in chosen.unchecked:
        rows.add_row(rollout_id, "not looked up", "", "", "", "")
    console.print(rows)


def _who() -> str:
    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no name for this uid (a container's)
        user = "someone"
    return f"{user}@{socket.gethostname()}"
