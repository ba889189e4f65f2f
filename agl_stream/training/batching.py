"""From complete trajectories to one update's samples (pure code): groups of attempts of the
same task, the staleness rule, the reward rule, group-relative advantages."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from agl_stream.events import Checkpoint, Resource
from agl_stream.training.advantages import group_advantages
from agl_stream.training.trajectories import AttemptKey, Trajectory
from agl_stream.training.triplets import (
    Problem,
    RewardRule,
    Triplet,
    build_triplets,
    policy_reward,
)


class StalePolicy(StrEnum):
    DROP = "drop"
    DOWNWEIGHT = "downweight"


@dataclass(frozen=True)
class Staleness:
    """Samples from a checkpoint more than `max_versions` updates of its policy behind the one
    being trained are dropped, or weighted by decay ** (updates beyond the bound). Versions
    are numbers of the policy's own steps (`policy_step`), not of the resources topic."""

    max_versions: int | None = None
    policy: StalePolicy = StalePolicy.DROP
    decay: float = 0.5

    def __post_init__(self) -> None:
        if self.max_versions is not None and self.max_versions < 0:
            raise ValueError(f"max staleness must be 0 or more versions, got {self.max_versions}")
        if not 0 < self.decay < 1:
            raise ValueError(f"the staleness decay must be in (0, 1), got {self.decay}")

    def weight(self, sample_version: int | None, current_version: int) -> float | None:
        """The weight of a sample, or None to drop it. A sample whose version is unknown
        counts as too stale when a bound is set."""
        if self.max_versions is None:
            return 1.0
        if sample_version is None:
            return None
        behind = current_version - sample_version
        if behind <= self.max_versions:
            return 1.0
        if self.policy is StalePolicy.DROP:
            return None
        return float(self.decay ** (behind - self.max_versions))


def policy_step(
    resources: Mapping[str, Resource], policy: str, step_of: Callable[[str], int | None]
) -> int | None:
    """The step of `policy` that a version holds: the step whose checkpoint of that policy
    it names, if the policy's trainer wrote it (`step_of`, its store's). What else the version
    holds and who published it (another policy's trainer, a joint version, a person) do not
    count: staleness is measured in updates of the policy being trained."""
    held = resources.get(policy)
    return step_of(held.uri) if isinstance(held, Checkpoint) else None


@dataclass(frozen=True)
class TrainSample:
    """One LLM call with its advantage, as the algorithm takes it."""

    key: AttemptKey
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    reward: float
    advantage: float
    weight: float
    logprobs: tuple[float, ...] | None


@dataclass
class StepInput:
    samples: list[TrainSample] = field(default_factory=list)
    used: list[AttemptKey] = field(default_factory=list)  # every trajectory consumed
    counts: Counter[str] = field(default_factory=Counter)
    problems: list[Problem] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)  # per trajectory

    @property
    def mean_reward(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else 0.0


class Groups:
    """Trajectories waiting for their group (attempts of one task) to fill up."""

    def __init__(
        self, group_size: int, groups_per_step: int, max_waiting: int | None = None
    ) -> None:
        if group_size < 1 or groups_per_step < 1:
            raise ValueError("group size and groups per step must be at least 1")
        if max_waiting is not None and max_waiting < group_size * groups_per_step:
            raise ValueError(
                f"at most {max_waiting} waiting trajectories cannot hold one step "
                f"({groups_per_step} groups of {group_size})"
            )
        self.group_size = group_size
        self.groups_per_step = groups_per_step
        self.max_waiting = max_waiting
        self._groups: dict[str, list[Trajectory]] = {}  # in the order their first member came

    def add(self, trajectories: Sequence[Trajectory]) -> None:
        for trajectory in trajectories:
            self._groups.setdefault(trajectory.group, []).append(trajectory)

    def _full(self) -> list[str]:
        return [k for k, v in self._groups.items() if len(v) >= self.group_size]

    def ready(self) -> bool:
        return len(self._full()) >= self.groups_per_step

    def _step_keys(self) -> list[str]:
        """The oldest full groups, as many as one step takes."""
        return self._full()[: self.groups_per_step]

    def next_step(self) -> list[Trajectory]:
        """The trajectories `take` would take now."""
        return [t for k in self._step_keys() for t in self._groups[k][: self.group_size]]

    def take(self) -> list[list[Trajectory]]:
        """The oldest full groups of one step (a group's surplus waits for the next)."""
        taken = []
        for key in self._step_keys():
            members = self._groups.pop(key)
            taken.append(members[: self.group_size])
            if members[self.group_size :]:
                self._groups[key] = members[self.group_size :]
        return taken

    def evict(self, unwanted: Callable[[Trajectory], bool]) -> list[Trajectory]:
        """Take out the trajectories a step would drop (too stale), so that they do not fill
        a group and hold back the fresh ones."""
        evicted = []
        for key, members in list(self._groups.items()):
            keep = [t for t in members if not unwanted(t)]
            evicted += [t for t in members if unwanted(t)]
            if keep:
                self._groups[key] = keep
            else:
                del self._groups[key]
        return evicted

    def overflow(self) -> list[Trajectory]:
        """Past `max_waiting`, the oldest groups that are not full leave (their task will
        never get enough attempts, or not soon): memory stays bounded whatever the inputs."""
        if self.max_waiting is None:
            return []
        dropped: list[Trajectory] = []
        waiting = self.waiting()
        for key, members in list(self._groups.items()):
            if waiting <= self.max_waiting:
                break
            if len(members) < self.group_size:
                dropped += self._groups.pop(key)
                waiting -= len(members)
        return dropped

    def waiting(self) -> int:
        return sum(len(v) for v in self._groups.values())


def _arrival_free(t: Trajectory) -> tuple[str, int, str]:
    return (t.input_json, t.attempt_number, t.rollout_id)


def build_step(
    groups: Sequence[Sequence[Trajectory]],
    versions: Mapping[str, int],
    current_version: int,
    staleness: Staleness,
    rule: RewardRule = RewardRule.FINAL,
    scale_rewards: bool = True,
    policy: str | None = None,
    agent_match: str | None = None,
) -> StepInput:
    """Triplets of every trajectory (the calls of `policy` only, when it is given; of the
    agents `agent_match` matches only, when it is given), weighted
    by staleness, with advantages computed over the triplets of each group. The samples come
    in an order that does not depend on when the attempts ended (groups by name, their
    members by input and attempt number): with seeded sampling, a run trains the same."""
    step = StepInput()
    pending: list[tuple[str, Trajectory, float]] = []
    for members in sorted(groups, key=lambda m: m[0].group if m else ""):
        for trajectory in sorted(members, key=_arrival_free):
            step.used.append(trajectory.key)
            version = versions.get(trajectory.resources_id or "")
            weight = staleness.weight(version, current_version)
            if weight is None:
                step.counts["dropped_stale"] += 1
                continue
            if weight < 1.0:
                step.counts["downweighted_stale"] += 1
            pending.append((trajectory.group, trajectory, weight))
    rows: list[tuple[str, float, Triplet]] = []
    for group, trajectory, weight in pending:
        adapted = build_triplets(trajectory, rule, policy=policy, agent_match=agent_match)
        step.problems.extend(adapted.problems)
        step.counts["calls_without_token_ids"] += sum(
            "token ids" in p.reason for p in adapted.problems
        )
        if not adapted.triplets:
            step.counts["trajectories_without_triplets"] += 1
            continue
        step.counts["trajectories"] += 1
        if trajectory.reward_from != "final":
            step.counts[f"late_reward_{trajectory.reward_from}"] += 1  # late | fallback
        step.rewards.append(policy_reward(trajectory, policy) or 0.0)
        rows.extend((group, weight, t) for t in adapted.triplets)
    advantages = group_advantages(
        [t.reward for _, _, t in rows], [g for g, _, _ in rows], scale=scale_rewards
    )
    for (_, weight, t), advantage in zip(rows, advantages, strict=True):
        step.samples.append(
            TrainSample(
                key=(t.rollout_id, t.attempt_id),
                prompt_ids=t.prompt_ids,
                response_ids=t.response_ids,
                reward=t.reward,
                advantage=advantage,
                weight=weight,
                logprobs=t.logprobs,
            )
        )
    step.counts["samples"] = len(step.samples)
    return step
