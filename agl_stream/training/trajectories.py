"""Whole trajectories out of events read in any interleaving across topics (pure code).

A trajectory is one finished attempt of a train-mode rollout with all its spans: the
RolloutQueued of its attempt number (task input, mode, metadata), its AttemptStarted
(resources id), every span up to the count on its AttemptFinished. Records come from
co-partitioned topics (tasks, rollouts, spans) in any order, duplicated or not.

The assembler also says how far the trainer may claim to have consumed each partition (the
cut): nothing below it is still needed. A rollout it still waits on holds the cut at its
lowest record; rollouts and attempts already settled are remembered while records of theirs
lie above the cut, so a trainer resumed from the cut neither re-uses nor loses any of them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agl_stream.events import (
    AttemptFinished,
    AttemptStarted,
    AttemptStatus,
    Event,
    RolloutFinished,
    RolloutMode,
    RolloutQueued,
    SpanRecorded,
)
from agl_stream.rewards import span_reward

# The co-partitioned topics a trajectory is assembled from.
TRAINED_TOPICS = ("tasks", "rollouts", "spans")
TopicPartition = tuple[str, int]  # (short topic name, partition)
AttemptKey = tuple[str, str]  # (rollout id, attempt id)


@dataclass(frozen=True)
class Trajectory:
    rollout_id: str
    attempt_id: str
    attempt_number: int
    input_json: str
    metadata: Mapping[str, str]
    resources_id: str | None
    status: AttemptStatus
    reward: float | None
    spans: tuple[SpanRecorded, ...]  # by sequence

    @property
    def key(self) -> AttemptKey:
        return (self.rollout_id, self.attempt_id)

    @property
    def group(self) -> str:
        """Attempts of the same task: the `group` metadata, else the same input."""
        return self.metadata.get("group") or self.input_json


@dataclass
class _Attempt:
    started: AttemptStarted | None = None
    finished: AttemptFinished | None = None
    spans: dict[int, SpanRecorded] = field(default_factory=dict)
    high: dict[TopicPartition, int] = field(default_factory=dict)
    handed: bool = False  # given out (or settled)
    settled: bool = False


@dataclass
class _Rollout:
    queued: dict[int, RolloutQueued] = field(default_factory=dict)
    attempts: dict[str, _Attempt] = field(default_factory=dict)
    finished_at: int | None = None  # the assembler's record count when RolloutFinished came
    counted: str | None = None  # the attempt whose success was handed out: the only one
    low: dict[TopicPartition, int] = field(default_factory=dict)
    high: dict[TopicPartition, int] = field(default_factory=dict)
    first_seen: int = 0  # the assembler's record count at its first record

    @property
    def train(self) -> bool | None:
        if not self.queued:
            return None
        return next(iter(self.queued.values())).mode == RolloutMode.TRAIN


def _seen(marks: dict[TopicPartition, int], tp: TopicPartition, offset: int) -> None:
    marks[tp] = max(marks.get(tp, -1), offset)


class Assembler:
    """Folds records into trajectories; `complete()` hands each one out once."""

    def __init__(self, patience_records: int = 50_000) -> None:
        # A finished rollout whose spans are still missing after this many more records
        # (a span lost to the dead-letter topic) is given up as incomplete, not waited on.
        self.patience_records = patience_records
        self.pending: dict[str, _Rollout] = {}
        self.settled_rollouts: dict[str, dict[TopicPartition, int]] = {}
        self.settled_attempts: dict[AttemptKey, dict[TopicPartition, int]] = {}
        self.counts: Counter[str] = Counter()
        self._ready: list[Trajectory] = []
        self._records = 0

    # -- input ------------------------------------------------------------------------------

    def add(self, tp: TopicPartition, offset: int, event: Event) -> None:
        self._records += 1
        rollout_id = getattr(event, "rollout_id", None)
        if rollout_id is None:
            return
        if rollout_id in self.settled_rollouts:
            _seen(self.settled_rollouts[rollout_id], tp, offset)
            return
        # Records of one attempt; RolloutFinished names an attempt too but is the rollout's.
        attempt_id = (
            getattr(event, "attempt_id", None)
            if isinstance(event, SpanRecorded | AttemptStarted | AttemptFinished)
            else None
        )
        if attempt_id is not None and (rollout_id, attempt_id) in self.settled_attempts:
            _seen(self.settled_attempts[(rollout_id, attempt_id)], tp, offset)
            return
        rollout = self.pending.get(rollout_id)
        if rollout is None:
            rollout = self.pending[rollout_id] = _Rollout(first_seen=self._records)
        rollout.low[tp] = min(rollout.low.get(tp, offset), offset)
        _seen(rollout.high, tp, offset)
        if attempt_id is not None:
            attempt = rollout.attempts.setdefault(attempt_id, _Attempt())
            _seen(attempt.high, tp, offset)
            if isinstance(event, SpanRecorded):
                attempt.spans.setdefault(event.sequence, event)
            elif isinstance(event, AttemptStarted) and attempt.started is None:
                attempt.started = event
            elif isinstance(event, AttemptFinished) and attempt.finished is None:
                attempt.finished = event
        elif isinstance(event, RolloutQueued):
            rollout.queued.setdefault(event.attempt_number, event)
        elif isinstance(event, RolloutFinished) and rollout.finished_at is None:
            rollout.finished_at = self._records
        self._check(rollout_id, rollout)

    def add_all(self, records: Iterable[tuple[TopicPartition, int, Event]]) -> None:
        for tp, offset, event in records:
            self.add(tp, offset, event)

    # -- output -----------------------------------------------------------------------------

    def complete(self) -> list[Trajectory]:
        """Trajectories completed since the last call."""
        ready, self._ready = self._ready, []
        return ready

    def settle(self, keys: Iterable[AttemptKey], reason: str = "used") -> None:
        """These handed-out trajectories are consumed: never hand them out again."""
        touched = set()
        for rollout_id, attempt_id in keys:
            rollout = self.pending.get(rollout_id)
            attempt = rollout.attempts.get(attempt_id) if rollout else None
            if rollout is None or attempt is None:
                raise KeyError(f"attempt {attempt_id} of rollout {rollout_id} is not pending")
            self._settle_attempt(rollout_id, attempt_id, attempt, reason)
            touched.add(rollout_id)
        for rollout_id in touched:
            self._check(rollout_id, self.pending[rollout_id])

    def cut(self, positions: Mapping[TopicPartition, int]) -> dict[TopicPartition, int]:
        """Per partition: the offset below which no record is needed any more."""
        for rollout_id, rollout in list(self.pending.items()):
            if rollout.finished_at is not None:
                self._check(rollout_id, rollout)  # gives up on what waited past its patience
            elif (
                rollout.train is None and self._records - rollout.first_seen > self.patience_records
            ):
                self._orphaned(rollout_id, rollout)
        cut = dict(positions)
        for rollout in self.pending.values():
            for tp, low in rollout.low.items():
                if tp in cut:
                    cut[tp] = min(cut[tp], low)
        return cut

    def prune(self, cut: Mapping[TopicPartition, int]) -> None:
        """Forget settled rollouts and attempts none of whose records lie at or above the cut."""

        def below(high: dict[TopicPartition, int]) -> bool:
            return all(offset < cut.get(tp, 0) for tp, offset in high.items())

        self.settled_rollouts = {k: v for k, v in self.settled_rollouts.items() if not below(v)}
        self.settled_attempts = {k: v for k, v in self.settled_attempts.items() if not below(v)}

    # -- state ------------------------------------------------------------------------------

    def memory(self) -> dict[str, Any]:
        """What a resumed assembler must remember (JSON-ready)."""
        return {
            "settled_rollouts": [
                [k, _marks_out(v)] for k, v in sorted(self.settled_rollouts.items())
            ],
            "settled_attempts": [
                [k[0], k[1], _marks_out(v)] for k, v in sorted(self.settled_attempts.items())
            ],
            "counted": sorted(
                [k, r.counted] for k, r in self.pending.items() if r.counted is not None
            ),
        }

    @classmethod
    def resume(cls, memory: Mapping[str, Any], patience_records: int = 50_000) -> Assembler:
        assembler = cls(patience_records)
        for rollout_id, marks in memory.get("settled_rollouts", []):
            assembler.settled_rollouts[rollout_id] = _marks_in(marks)
        for rollout_id, attempt_id, marks in memory.get("settled_attempts", []):
            assembler.settled_attempts[(rollout_id, attempt_id)] = _marks_in(marks)
        for rollout_id, attempt_id in memory.get("counted", []):
            assembler.pending[rollout_id] = _Rollout(counted=attempt_id)
        return assembler

    # -- the fold ---------------------------------------------------------------------------

    def _settle_attempt(
        self, rollout_id: str, attempt_id: str, attempt: _Attempt, why: str
    ) -> None:
        self.settled_attempts[(rollout_id, attempt_id)] = dict(attempt.high)
        self.counts[why] += 1
        attempt.handed = attempt.settled = True
        attempt.spans = {}  # the memory of a settled attempt is its offsets only

    def _check(self, rollout_id: str, rollout: _Rollout) -> None:
        train = rollout.train
        if train is False:
            self._retire(rollout_id, rollout, "rollouts_not_train")
            return
        for attempt_id, attempt in rollout.attempts.items():
            if attempt.handed or train is None:
                continue
            trajectory = self._trajectory(rollout_id, attempt_id, rollout, attempt)
            if trajectory is None:
                continue
            if trajectory.status != AttemptStatus.SUCCEEDED:
                self._settle_attempt(
                    rollout_id, attempt_id, attempt, f"attempts_{trajectory.status.value}"
                )
                continue
            if rollout.counted not in (None, attempt_id):
                # A second success of one rollout: a runner cut off from the broker finished
                # an attempt that another runner had already taken over (execution is
                # at-least-once). The rollout counts once.
                self._settle_attempt(rollout_id, attempt_id, attempt, "attempts_second_success")
                continue
            rollout.counted = attempt_id
            attempt.handed = True
            self._ready.append(trajectory)
        if rollout.finished_at is None:
            return
        given_up = self._records - rollout.finished_at > self.patience_records
        waiting = [a for a in rollout.attempts.values() if a.finished is not None and not a.handed]
        if waiting and given_up:
            for attempt_id, attempt in rollout.attempts.items():
                if attempt.finished is not None and not attempt.handed:
                    self._settle_attempt(rollout_id, attempt_id, attempt, "attempts_incomplete")
            waiting = []
        in_use = [a for a in rollout.attempts.values() if a.handed and not a.settled]
        if waiting or in_use or (train is None and rollout.attempts and not given_up):
            return
        for attempt_id, attempt in rollout.attempts.items():
            if not attempt.settled:
                # Started, never finished: its runner died and the rollout went on without it.
                self._settle_attempt(rollout_id, attempt_id, attempt, "attempts_abandoned")
        self._retire(rollout_id, rollout, "rollouts_finished")

    def _orphaned(self, rollout_id: str, rollout: _Rollout) -> None:
        """Records of a rollout that neither was queued nor ended where this assembler read
        (spans a cut-off runner committed after another had finished the rollout, which was
        forgotten since): given up after the patience, so they never hold the cut back."""
        for attempt_id, attempt in rollout.attempts.items():
            if not attempt.settled:
                self._settle_attempt(rollout_id, attempt_id, attempt, "attempts_orphaned")
        self._retire(rollout_id, rollout, "rollouts_orphaned")

    def _retire(self, rollout_id: str, rollout: _Rollout, why: str) -> None:
        self.settled_rollouts[rollout_id] = dict(rollout.high)
        self.counts[why] += 1
        self.pending.pop(rollout_id, None)

    def _trajectory(
        self, rollout_id: str, attempt_id: str, rollout: _Rollout, attempt: _Attempt
    ) -> Trajectory | None:
        finished, started = attempt.finished, attempt.started
        if finished is None or started is None:
            return None
        queued = rollout.queued.get(started.attempt_number)
        if queued is None or any(s not in attempt.spans for s in range(finished.span_count)):
            return None
        spans = tuple(attempt.spans[s] for s in range(finished.span_count))
        return Trajectory(
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            attempt_number=started.attempt_number,
            input_json=queued.input_json,
            metadata=dict(queued.metadata),
            resources_id=started.resources_id,
            status=finished.status,
            reward=finished.reward if finished.reward is not None else _last_reward(spans),
            spans=spans,
        )


def _last_reward(spans: tuple[SpanRecorded, ...]) -> float | None:
    for span in reversed(spans):
        value = span_reward(span.name, span.attributes)
        if value is not None:
            return value
    return None


def _marks_out(marks: Mapping[TopicPartition, int]) -> dict[str, int]:
    return {f"{topic}:{partition}": offset for (topic, partition), offset in sorted(marks.items())}


def partition_of(name: str) -> TopicPartition:
    """ "spans:3" -> ("spans", 3): how partitions are named in checkpoints."""
    topic, _, partition = name.rpartition(":")
    return (topic, int(partition))


def _marks_in(marks: Mapping[str, int]) -> dict[TopicPartition, int]:
    return {partition_of(name): int(offset) for name, offset in marks.items()}
