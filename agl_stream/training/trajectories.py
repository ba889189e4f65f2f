"""Whole trajectories out of events read in any interleaving across topics (pure code).

A trajectory is one finished attempt of a train-mode rollout with all its spans: the
RolloutQueued of its attempt number (task input, mode, metadata), its AttemptStarted
(resources id), every span up to the count on its AttemptFinished. Records come from
co-partitioned topics (tasks, rollouts, spans) in any order, duplicated or not.

Rewards given from outside an attempt (RewardRecorded, on the rollouts topic) join the
trajectory when they count (after an attempt of their rollout in its partition). With a
late-reward rule a succeeded trajectory waits for its named reward up to a bound, measured in
the broker time of its rollouts partition: a reward stamped up to `wait` after the attempt's
end counts (the first of that name in the partition's order); past it the trajectory is
dropped or falls back to its final reward.

The assembler also says how far the trainer may claim to have consumed each partition (the
cut): nothing below it is still needed. A rollout it still waits on holds the cut at its
lowest record; rollouts and attempts already settled are remembered while records of theirs
lie above the cut, so a trainer resumed from the cut neither re-uses nor loses any of them.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from agl_stream.agent.llm import LLM_CALL_SPAN, RESOURCES_ID
from agl_stream.events import (
    AttemptFinished,
    AttemptStarted,
    AttemptStatus,
    Event,
    RewardRecorded,
    RolloutFinished,
    RolloutMode,
    RolloutQueued,
    SpanRecorded,
)
from agl_stream.events.reward_rules import late_reward_refusal, record_time, span_reward

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
    # The late reward the rule waited for, when one came (its value is `reward`).
    late_reward: RewardRecorded | None = None
    reward_from: str = "final"  # final | late | fallback (the rule's reward did not come)

    @property
    def key(self) -> AttemptKey:
        return (self.rollout_id, self.attempt_id)

    @property
    def group(self) -> str:
        """Attempts of the same task: the `group` metadata, else the same input."""
        return self.metadata.get("group") or self.input_json


class MissingLateReward(StrEnum):
    DROP = "drop"
    FINAL = "final"


@dataclass(frozen=True)
class LateRewardRule:
    """Train on the reward named `name` given after the attempt (RewardRecorded): a succeeded
    trajectory waits for it until its rollouts partition's broker time passes the attempt's
    end plus `wait_seconds`; then it is dropped, or trained on its final reward."""

    name: str
    wait_seconds: float = 60.0
    missing: MissingLateReward = MissingLateReward.DROP

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a late-reward rule needs the reward's name")
        if self.wait_seconds < 0:
            raise ValueError(f"the late-reward wait must be 0 or more, got {self.wait_seconds}")


@dataclass
class _Attempt:
    started: AttemptStarted | None = None
    finished: AttemptFinished | None = None
    finished_ms: int | None = None  # the broker time of its AttemptFinished record
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
    rewards: list[RewardRecorded] = field(default_factory=list)  # late rewards that count
    lifecycle: TopicPartition | None = None  # its rollouts partition
    low: dict[TopicPartition, int] = field(default_factory=dict)
    high: dict[TopicPartition, int] = field(default_factory=dict)
    first_seen: int = 0  # the assembler's record count at its first record

    @property
    def train(self) -> bool | None:
        if self.queued:
            return next(iter(self.queued.values())).mode == RolloutMode.TRAIN
        for attempt in self.attempts.values():  # an attempt nobody queued says its task
            if attempt.started is not None and attempt.started.task is not None:
                return attempt.started.task.mode == RolloutMode.TRAIN
        return None


def _seen(marks: dict[TopicPartition, int], tp: TopicPartition, offset: int) -> None:
    marks[tp] = max(marks.get(tp, -1), offset)


class Assembler:
    """Folds records into trajectories; `complete()` hands each one out once."""

    def __init__(
        self, patience_records: int = 50_000, late_reward: LateRewardRule | None = None
    ) -> None:
        # A finished rollout whose spans are still missing after this many more records
        # (a span lost to the dead-letter topic) is given up as incomplete, not waited on.
        self.patience_records = patience_records
        self.pending: dict[str, _Rollout] = {}
        self.settled_rollouts: dict[str, dict[TopicPartition, int]] = {}
        self.settled_attempts: dict[AttemptKey, dict[TopicPartition, int]] = {}
        self.counts: Counter[str] = Counter()
        self.late_reward = late_reward
        self._ready: list[Trajectory] = []
        self._dropped: list[Trajectory] = []  # the late reward did not come: no training
        self._records = 0
        self._clock: dict[TopicPartition, int] = {}  # rollouts partition -> broker time, ms
        self._held: set[str] = set()  # rollouts with a trajectory waiting for a late reward
        # Per rollouts partition, (deadline ms, rollout id) of those waiting, soonest first:
        # broker time passing a deadline looks at that rollout again (-1: deadline not known).
        self._deadlines: dict[TopicPartition, list[tuple[int, str]]] = {}

    # -- input ------------------------------------------------------------------------------

    def add(
        self, tp: TopicPartition, offset: int, event: Event, timestamp_ms: int | None = None
    ) -> None:
        self._records += 1
        rollout_id = getattr(event, "rollout_id", None)
        if rollout_id is None:
            return
        if tp[0] == "rollouts" and timestamp_ms is not None:
            self._advance(tp, timestamp_ms)
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
                rollout.lifecycle = tp
            elif isinstance(event, AttemptFinished) and attempt.finished is None:
                attempt.finished = event
                attempt.finished_ms = timestamp_ms
                rollout.lifecycle = tp
        elif isinstance(event, RewardRecorded):
            self._reward(rollout, event, timestamp_ms)
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

    def dropped(self) -> list[Trajectory]:
        """Trajectories whose late reward did not come in time (the rule drops them), since
        the last call: handed out once, for the next step's lineage, never for training."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def tick(self, now_ms: int, caught_up: Iterable[TopicPartition]) -> None:
        """Broker time goes on in rollouts partitions read to their end: a record appended
        later is stamped later than `now_ms`, so late rewards not there yet came too late."""
        for tp in caught_up:
            if tp[0] == "rollouts":
                self._advance(tp, now_ms)

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

    def _advance(self, tp: TopicPartition, timestamp_ms: int) -> None:
        if timestamp_ms <= self._clock.get(tp, -1):
            return
        self._clock[tp] = timestamp_ms
        due = self._deadlines.get(tp, [])
        while due and due[0][0] < timestamp_ms:
            _, rollout_id = heapq.heappop(due)
            if rollout_id in self._held:
                self._held.discard(rollout_id)  # _check holds it again if it still waits
                self._check(rollout_id, self.pending[rollout_id])

    def _hold(
        self, rollout_id: str, rollout: _Rollout, attempt: _Attempt, rule: LateRewardRule
    ) -> None:
        if rollout_id in self._held or rollout.lifecycle is None:
            return
        self._held.add(rollout_id)
        ended = attempt.finished_ms
        deadline = -1 if ended is None else ended + int(rule.wait_seconds * 1000)
        heapq.heappush(self._deadlines.setdefault(rollout.lifecycle, []), (deadline, rollout_id))

    def _reward(self, rollout: _Rollout, event: RewardRecorded, timestamp_ms: int | None) -> None:
        before = [a for a, x in rollout.attempts.items() if x.started or x.finished]
        recorded_at = None if timestamp_ms is None else record_time(timestamp_ms)
        refusal = late_reward_refusal(
            event.rollout_id, event.attempt_id, before, event.occurred_at, recorded_at
        )
        if refusal is not None:
            self.counts["late_rewards_refused"] += 1  # the projector dead-letters it
            return
        rollout.rewards.append(event)

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
    def resume(
        cls,
        memory: Mapping[str, Any],
        patience_records: int = 50_000,
        late_reward: LateRewardRule | None = None,
    ) -> Assembler:
        assembler = cls(patience_records, late_reward)
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
            if self.late_reward is not None:
                ruled = self._late(rollout, attempt, trajectory, self.late_reward)
                if ruled is None:
                    self._hold(rollout_id, rollout, attempt, self.late_reward)
                    continue
                if ruled.reward_from == "dropped":
                    attempt.handed = True
                    self._dropped.append(ruled)
                    continue
                trajectory = ruled
            rollout.counted = attempt_id
            attempt.handed = True
            self._ready.append(trajectory)
        if not any(
            a.finished is not None and not a.handed and a.finished.status is AttemptStatus.SUCCEEDED
            for a in rollout.attempts.values()
        ):
            self._held.discard(rollout_id)
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

    def _late(
        self, rollout: _Rollout, attempt: _Attempt, trajectory: Trajectory, rule: LateRewardRule
    ) -> Trajectory | None:
        """The trajectory as the rule has it: with its late reward, falling back to its final
        reward, dropped (reward_from "dropped"), or None while it waits."""
        named = [
            r
            for r in rollout.rewards
            if r.name == rule.name and r.attempt_id in (None, trajectory.attempt_id)
        ]
        if named:
            # The first that counts in the partition's order: what the trainer takes is then
            # the same whenever the other topics' records come (a retrain agrees with the live
            # run); a later correction is for the read model and exports.
            late = named[0]
            return replace(trajectory, reward=late.value, late_reward=late, reward_from="late")
        now = self._clock.get(rollout.lifecycle) if rollout.lifecycle else None
        if attempt.finished_ms is None:  # a record without a broker time: from when seen
            attempt.finished_ms = now
        ended = attempt.finished_ms
        if now is None or ended is None or now <= ended + rule.wait_seconds * 1000:
            return None
        if rule.missing is MissingLateReward.FINAL:
            return replace(trajectory, reward_from="fallback")
        return replace(trajectory, reward_from="dropped")

    def _orphaned(self, rollout_id: str, rollout: _Rollout) -> None:
        """Records of a rollout that neither was queued nor ended where this assembler read
        (spans a cut-off runner committed after another had finished the rollout, which was
        forgotten since): given up after the patience, so they never hold the cut back."""
        for attempt_id, attempt in rollout.attempts.items():
            if not attempt.settled:
                self._settle_attempt(rollout_id, attempt_id, attempt, "attempts_orphaned")
        self._retire(rollout_id, rollout, "rollouts_orphaned")

    def _retire(self, rollout_id: str, rollout: _Rollout, why: str) -> None:
        self._held.discard(rollout_id)
        self.settled_rollouts[rollout_id] = dict(rollout.high)
        self.counts[why] += 1
        self.pending.pop(rollout_id, None)

    def _trajectory(
        self, rollout_id: str, attempt_id: str, rollout: _Rollout, attempt: _Attempt
    ) -> Trajectory | None:
        finished, started = attempt.finished, attempt.started
        if finished is None or started is None:
            return None
        queued = rollout.queued.get(started.attempt_number) or started.task
        if queued is None:
            return None
        spans = _whole(attempt.spans, finished.span_count)
        if spans is None:
            return None
        return Trajectory(
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            attempt_number=started.attempt_number,
            input_json=queued.input_json,
            metadata=dict(queued.metadata),
            # An attempt started on no known version (a gateway session) is as old as the
            # version that answered its first call.
            resources_id=started.resources_id or _served_by(spans),
            status=finished.status,
            reward=finished.reward if finished.reward is not None else _last_reward(spans),
            spans=spans,
        )


def _whole(spans: Mapping[int, SpanRecorded], count: int) -> tuple[SpanRecorded, ...] | None:
    """An attempt's spans once all `count` are there, else None. A runner numbers its spans
    0 to count - 1, in the order it made them; an ingester numbers them by their span ids
    (agl_stream.otlp.mapping), so such an attempt is whole with `count` distinct spans, in
    the order they started."""
    if all(s in spans for s in range(count)):
        return tuple(spans[s] for s in range(count))
    if len(spans) < count:
        return None
    return tuple(sorted(spans.values(), key=lambda s: (s.start_time_unix_nano, s.sequence)))


def _served_by(spans: tuple[SpanRecorded, ...]) -> str | None:
    for span in spans:
        served = span.attributes.get(RESOURCES_ID) if span.name == LLM_CALL_SPAN else None
        if isinstance(served, str):
            return served
    return None


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
