"""What a runner knows about the rollouts of its partitions, folded from the events.

The rollouts topic is partitioned like the tasks topic, so the owner of tasks partition p
reads rollouts partition p to learn which rollouts already finished, which attempts ended,
and which were cancelled, before it runs anything again.
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
    cancel: RolloutCancelled | None = None
    # Where on the rollouts partition the facts above are (None: not known, e.g. written
    # by this runner in a transaction not committed yet): a plan that relies on a fact
    # tells the commit how far back the next owner must fold (see offsets.py).
    terminal_at: int | None = None
    # attempt number -> where its (earliest) AttemptFinished is
    finished_at: dict[int, int | None] = field(default_factory=dict)
    last_record: int = -1  # the highest tasks offset of a record of this rollout planned


class Action(Enum):
    RUN = "run"  # execute a new attempt
    SKIP = "skip"  # already done, or a duplicate of one in flight
    CANCEL = "cancel"  # finish the rollout as cancelled without running it


@dataclass(frozen=True)
class Plan:
    action: Action
    # The rollouts offset of the fact the plan relies on (SKIP of a finished rollout or
    # attempt); None when it relies on none there, or on one whose offset is not known yet.
    relies_on: int | None = None


@dataclass
class Ledger:
    """One tasks partition's rollouts (each rollout lives in one partition)."""

    rollouts: dict[str, RolloutState] = field(default_factory=dict)

    def state(self, rollout_id: str) -> RolloutState:
        return self.rollouts.setdefault(rollout_id, RolloutState())

    def apply(self, event: Event, offset: int | None = None) -> None:
        """Fold one lifecycle event (rollouts topic, at `offset` when known) or task record
        (tasks topic)."""
        if isinstance(event, RolloutFinished):
            state = self.state(event.rollout_id)
            if state.terminal is None:
                state.terminal = event.status
            state.terminal_at = _earliest(state.terminal_at, offset)
        elif isinstance(event, AttemptFinished):
            state = self.state(event.rollout_id)
            earlier = state.finished_at.get(event.attempt_number)
            state.finished_at[event.attempt_number] = _earliest(earlier, offset)
        elif isinstance(event, RolloutCancelled):
            state = self.state(event.rollout_id)
            if state.terminal is None:
                state.cancel = event

    def planned(self, rollout_id: str, task_offset: int) -> None:
        """A record of the rollout at `task_offset` was planned."""
        state = self.state(rollout_id)
        state.last_record = max(state.last_record, task_offset)

    def prune(self, committed: int) -> int:
        """Forget finished rollouts whose records all lie below the committed tasks offset
        (what a next owner would fold again if it needed them), and cancels the loop read
        below it for rollouts with nothing pending (a cancel of a rollout that finished and
        was forgotten); returns how many. Only when every inherited record was planned:
        the fold's facts are for those."""
        done = [
            rollout_id
            for rollout_id, state in self.rollouts.items()
            if state.last_record < committed
            and (state.terminal is not None or _only_cancelled(state))
        ]
        for rollout_id in done:
            del self.rollouts[rollout_id]
        return len(done)

    def plan(self, task: RolloutQueued, running: Container[tuple[str, int]]) -> Plan:
        """What to do with a queued rollout record now. An attempt's end commits together
        with what follows it (a retry record or the rollout's end), so an attempt known to
        have finished needs nothing more: its retry, if any, is a later record."""
        state = self.rollouts.get(task.rollout_id, RolloutState())
        if state.terminal is not None:
            return Plan(Action.SKIP, relies_on=state.terminal_at)
        if (task.rollout_id, task.attempt_number) in running:
            return Plan(Action.SKIP)
        if state.cancel is not None:
            return Plan(Action.CANCEL)
        if task.attempt_number not in state.finished_at:
            return Plan(Action.RUN)
        return Plan(Action.SKIP, relies_on=state.finished_at.get(task.attempt_number))


def _only_cancelled(state: RolloutState) -> bool:
    """A cancel whose record the loop read (a cancel the watch read ahead is kept until
    then: last_record stays -1), with no attempt ended that a retry could follow."""
    return state.cancel is not None and not state.finished_at and state.last_record >= 0


def _earliest(known: int | None, offset: int | None) -> int | None:
    if known is None:
        return offset
    return known if offset is None else min(known, offset)


def cancelled_error(cancel: RolloutCancelled) -> ErrorInfo:
    reason = cancel.reason or "cancelled"
    by = f" by {cancel.requested_by}" if cancel.requested_by else ""
    return ErrorInfo(type="Cancelled", message=f"{reason}{by}")


__all__ = ["Action", "Ledger", "Plan", "RolloutState", "cancelled_error"]
