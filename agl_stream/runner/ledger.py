"""What a runner knows about the rollouts of its partitions, folded from the events.

The rollouts topic is partitioned like the tasks topic, so the owner of tasks partition p
reads rollouts partition p to learn which rollouts already finished, which attempts ended,
and whether a decision after an attempt was already taken, before it runs anything again.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field
from enum import Enum

from agl_stream.events import (
    AttemptFinished,
    ErrorInfo,
    Event,
    RolloutCancelled,
    RolloutFinished,
    RolloutQueued,
    RolloutStatus,
)


@dataclass
class RolloutState:
    terminal: RolloutStatus | None = None
    # attempt number -> the last attempt with that number that finished
    finished: dict[int, AttemptFinished] = field(default_factory=dict)
    queued_numbers: set[int] = field(default_factory=set)
    cancel: RolloutCancelled | None = None


class Action(Enum):
    RUN = "run"  # execute a new attempt
    SKIP = "skip"  # already done, or a duplicate of one in flight
    CANCEL = "cancel"  # finish the rollout as cancelled without running it
    DECIDE = "decide"  # the attempt ran, but what follows it was never published


@dataclass(frozen=True)
class Plan:
    action: Action
    finished: AttemptFinished | None = None  # for DECIDE: the attempt to decide on


@dataclass
class Ledger:
    rollouts: dict[str, RolloutState] = field(default_factory=dict)

    def state(self, rollout_id: str) -> RolloutState:
        return self.rollouts.setdefault(rollout_id, RolloutState())

    def apply(self, event: Event) -> None:
        """Fold one lifecycle event (rollouts topic) or task record (tasks topic)."""
        if isinstance(event, RolloutFinished):
            self.state(event.rollout_id).terminal = event.status
        elif isinstance(event, AttemptFinished):
            self.state(event.rollout_id).finished[event.attempt_number] = event
        elif isinstance(event, RolloutQueued):
            self.state(event.rollout_id).queued_numbers.add(event.attempt_number)
        elif isinstance(event, RolloutCancelled):
            state = self.state(event.rollout_id)
            if state.terminal is None:
                state.cancel = event

    def plan(self, task: RolloutQueued, running: Container[tuple[str, int]]) -> Plan:
        """What to do with a queued rollout record now."""
        state = self.rollouts.get(task.rollout_id, RolloutState())
        if state.terminal is not None or (task.rollout_id, task.attempt_number) in running:
            return Plan(Action.SKIP)
        if state.cancel is not None:
            return Plan(Action.CANCEL)
        done = state.finished.get(task.attempt_number)
        if done is None:
            return Plan(Action.RUN)
        later = any(n > task.attempt_number for n in state.queued_numbers | set(state.finished))
        return Plan(Action.SKIP) if later else Plan(Action.DECIDE, done)


def cancelled_error(cancel: RolloutCancelled) -> ErrorInfo:
    reason = cancel.reason or "cancelled"
    by = f" by {cancel.requested_by}" if cancel.requested_by else ""
    return ErrorInfo(type="Cancelled", message=f"{reason}{by}")


__all__ = ["Action", "Ledger", "Plan", "RolloutState", "cancelled_error"]
