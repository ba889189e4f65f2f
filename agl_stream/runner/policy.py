"""What happens to a rollout when one of its attempts ends."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from agl_stream.events import AttemptStatus, ErrorInfo, RolloutQueued, RolloutStatus
from agl_stream.events.base import utc_now

# Retries get a deterministic event id: a runner that crashes after queuing a retry and
# decides again publishes the same event, which consumers recognise.
_RETRY_NAMESPACE = uuid.UUID("6f2a3c1e-0d4b-4c55-9a57-1f0e2b7d9c31")


@dataclass(frozen=True)
class Requeue:
    queued: RolloutQueued


@dataclass(frozen=True)
class Finish:
    status: RolloutStatus
    error: ErrorInfo | None


Decision = Requeue | Finish


def retry_event_id(rollout_id: str, attempt_number: int) -> uuid.UUID:
    return uuid.uuid5(_RETRY_NAMESPACE, f"{rollout_id}/{attempt_number}")


def decide(
    task: RolloutQueued, attempt_id: str, status: AttemptStatus, error: ErrorInfo | None
) -> Decision:
    """Succeeded finishes; a status in the retry condition requeues while attempts remain;
    anything else fails the rollout for good."""
    if status == AttemptStatus.SUCCEEDED:
        return Finish(RolloutStatus.SUCCEEDED, None)
    if status in task.retry_condition and task.attempt_number < task.max_attempts:
        return Requeue(
            task.model_copy(
                update={
                    "event_id": retry_event_id(task.rollout_id, task.attempt_number + 1),
                    "occurred_at": utc_now(),
                    "attempt_number": task.attempt_number + 1,
                    "previous_attempt_id": attempt_id,
                }
            )
        )
    return Finish(RolloutStatus.FAILED, error or ErrorInfo(type=status.value, message=status.value))
