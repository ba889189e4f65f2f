"""Running a finished rollout again: a new rollout with the same input and settings, whose
metadata names the one it copies (`requeued_from`). The finished rollout's history stays as
it is: events are never rewritten, and a rollout that ended is never reopened."""

from __future__ import annotations

from agl_stream.commands.enqueue import RolloutOptions, enqueue_batch, rollout_ids
from agl_stream.events import AttemptStatus, RolloutMode
from agl_stream.queries import Rollout
from agl_stream.runtime.config import KafkaSettings

REQUEUED_FROM = "requeued_from"
FINISHED_STATUSES = ("succeeded", "failed", "cancelled")


class RequeueError(ValueError):
    """A rollout that cannot be run again as asked; the message says why."""


def copy_options(rollout: Rollout) -> RolloutOptions:
    """The settings of `rollout` for its copy (pure); its metadata names the original."""
    return RolloutOptions(
        mode=RolloutMode(rollout.mode or RolloutMode.TRAIN.value),
        resources_id=rollout.resources_id,
        timeout_seconds=rollout.timeout_seconds,
        unresponsive_seconds=rollout.unresponsive_seconds,
        max_attempts=rollout.max_attempts or 1,
        retry_condition=tuple(AttemptStatus(s) for s in rollout.retry_condition or ()),
        metadata={**rollout.metadata, REQUEUED_FROM: rollout.rollout_id},
    )


async def requeue(kafka: KafkaSettings, rollout: Rollout) -> str:
    """Queue a copy of a finished rollout; returns the copy's id once the broker has it.

    Asking twice for the same finished rollout queues one copy (the id is derived from the
    original's id and attempt count, through enqueue's keyed, resumable path); requeue the
    copy to run it once more."""
    if rollout.status not in FINISHED_STATUSES:
        raise RequeueError(
            f"rollout {rollout.rollout_id!r} is {rollout.status}, not finished: only a "
            f"{', '.join(FINISHED_STATUSES)} rollout can be requeued (cancel it first)"
        )
    key = f"requeue:{rollout.rollout_id}:{rollout.attempt_count}"
    copy_id = rollout_ids(key, 1)[0]
    await enqueue_batch(kafka, [rollout.input], copy_options(rollout), key=key, ids=[copy_id])
    return copy_id
