"""`agl-stream requeue`."""

from __future__ import annotations

import click

from agl_stream.cli.common import AppContext, console, fail, friendly_errors, read_model_option, run
from agl_stream.commands.requeue import FINISHED_STATUSES, RequeueError, requeue
from agl_stream.queries import ReadModel, Rollout


@click.command("requeue")
@click.argument("rollout_ids", nargs=-1, required=True, metavar="ROLLOUT_ID...")
@read_model_option("Look rollouts up in")
@click.pass_obj
@friendly_errors
def requeue_command(app: AppContext, rollout_ids: tuple[str, ...], read_model: str | None) -> None:
    """Run finished rollouts again: each as a new rollout with the same input and settings,
    whose metadata says `requeued_from=ROLLOUT_ID`. Asking again for the same finished
    rollout queues no second copy. Prints `ROLLOUT_ID -> NEW_ID` for each.

    \b
    Example:
        agl-stream requeue ro-1 ro-2
    """

    async def main() -> list[tuple[str, str]]:
        async with ReadModel.open(app.database(), read_model) as model:
            found = await model.rollouts_by_id(rollout_ids)
            missing = [i for i in rollout_ids if i not in found]
            if missing:
                fail(
                    f"the read model has no rollout {', '.join(map(repr, missing))} (never "
                    "queued, or not projected yet); nothing was requeued"
                )
            chosen: list[Rollout] = [found[i] for i in dict.fromkeys(rollout_ids)]
            unfinished = [r for r in chosen if r.status not in FINISHED_STATUSES]
            if unfinished:
                raise click.UsageError(
                    "only finished rollouts can be requeued; not finished: "
                    + ", ".join(f"{r.rollout_id} ({r.status})" for r in unfinished)
                )
            return [(r.rollout_id, await requeue(app.kafka(), r)) for r in chosen]

    try:
        pairs = run(main())
    except RequeueError as exc:
        raise click.UsageError(str(exc)) from None
    for original, copy in pairs:
        console.print(f"{original} -> {copy}", highlight=False)
