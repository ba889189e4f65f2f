"""`agl-stream enqueue`."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from agl_stream.cli.common import (
    AppContext,
    PathType,
    console,
    friendly_errors,
    parse_key_values,
    run,
)
from agl_stream.commands.enqueue import (
    EnqueueError,
    RolloutOptions,
    batch_key,
    enqueue_batch,
    read_located_tasks,
)
from agl_stream.events import AttemptStatus, RolloutMode

RETRYABLE = ["failed", "timeout", "unresponsive"]


@click.command("enqueue")
@click.argument("source", required=False, type=PathType(dir_okay=False, path_type=Path))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["jsonl", "json", "parquet"]),
    help="File format. [default: from the file name; JSONL on stdin]",
)
@click.option(
    "--mode", type=click.Choice([m.value for m in RolloutMode]), default="train", show_default=True
)
@click.option("--resources-id", help="Run with this resources version instead of the latest.")
@click.option(
    "--timeout",
    "timeout_seconds",
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds an attempt may run.",
)
@click.option(
    "--unresponsive",
    "unresponsive_seconds",
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds without a span before an attempt counts as unresponsive.",
)
@click.option("--max-attempts", type=click.IntRange(1, 100), default=1, show_default=True)
@click.option(
    "--retry-on",
    multiple=True,
    type=click.Choice(RETRYABLE),
    help="Attempt outcome that requeues the rollout (repeatable).",
)
@click.option(
    "--metadata", multiple=True, metavar="KEY=VALUE", help="Metadata on every rollout (repeatable)."
)
@click.option(
    "--key",
    help="Names this enqueue: run again with the same key, it queues only what is not queued "
    "yet. [default: a digest of the task inputs and options]",
)
@click.option(
    "--again",
    is_flag=True,
    help="Queue the inputs as new rollouts even if they were queued before.",
)
@click.option("--print-ids", is_flag=True, help="Print the rollout ids, one per line.")
@click.pass_obj
@friendly_errors
def enqueue_command(
    app: AppContext,
    source: Path | None,
    fmt: str | None,
    mode: str,
    resources_id: str | None,
    timeout_seconds: float | None,
    unresponsive_seconds: float | None,
    max_attempts: int,
    retry_on: tuple[str, ...],
    metadata: tuple[str, ...],
    key: str | None,
    again: bool,
    print_ids: bool,
) -> None:
    """Queue one rollout per task input read from SOURCE (.jsonl, .json or .parquet) or,
    without SOURCE, from JSONL on standard input. Task inputs that are objects with a
    string "rollout_id" keep it as their id; the others get ro-<digest of the key>-<index>.

    Safe to run again: the same inputs with the same options (or the same --key) queue
    only what an earlier run did not (a run cut off half-way is completed, a finished one
    is not repeated); --again queues them as new rollouts."""
    if source is not None and not source.is_file():
        raise click.BadParameter(f"no such file: {source}", param_hint="SOURCE")
    if key is not None and not key.strip():
        raise click.BadParameter(
            "an empty key names nothing: give a name, or leave --key out for a digest of the "
            "task inputs and options",
            param_hint="--key",
        )
    options = RolloutOptions(
        mode=RolloutMode(mode), resources_id=resources_id, timeout_seconds=timeout_seconds,
        unresponsive_seconds=unresponsive_seconds, max_attempts=max_attempts,
        retry_condition=tuple(AttemptStatus(s) for s in retry_on),
        metadata=parse_key_values(metadata, "--metadata"),
    )  # fmt: skip
    try:
        located = list(read_located_tasks(source, fmt, sys.stdin))
    except EnqueueError as exc:
        raise click.BadParameter(str(exc), param_hint="SOURCE") from None
    where, tasks = [place for place, _ in located], [task for _, task in located]
    if not tasks:
        raise click.UsageError("no task inputs to queue")
    if again and key is not None:
        raise click.UsageError("--again and --key exclude each other: --again picks a new key")
    if not again and key is None:
        key = batch_key(tasks, options)
    columns = (TextColumn("queuing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, disable=print_ids) as progress:
        bar = progress.add_task("queuing", total=len(tasks))
        sent = functools.partial(progress.advance, bar)
        try:
            done = run(enqueue_batch(app.kafka(), tasks, options, key, sent, where=where))
        except EnqueueError as exc:
            raise click.UsageError(str(exc)) from None
    if print_ids:
        click.echo("\n".join(done.ids))
        return
    topic = app.kafka().topic("tasks")
    if done.queued_now == len(done.ids):
        console.print(f"queued {len(done.ids)} rollouts on {topic}", highlight=False)
    elif done.queued_now == 0:
        console.print(
            f"all {len(done.ids)} rollouts were queued on {topic} before (the same inputs and "
            "options); nothing queued again (--again queues them as new rollouts)",
            highlight=False,
        )
    else:
        console.print(
            f"queued {done.queued_now} rollouts on {topic}; the other "
            f"{len(done.ids) - done.queued_now} were queued by an earlier run",
            highlight=False,
        )
