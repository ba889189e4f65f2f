"""APO's beam search and its memory (pure code).

The state is everything a restarted optimizer needs to go on without repeating an effect:
each candidate's text (an LLM's answer cannot be asked for twice and come out the same), the
versions it assigned, the batches of rollouts it started and finished queuing, the critiques
it has, the beam, and the versions it published. It is written after every step.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

STATE_FILE = "apo-state.json"


@dataclass
class Candidate:
    cid: str  # c0 (the seed), c1, c2, ...
    template: str
    parent: str | None
    round: int
    version: int
    resources_id: str
    rejected: str | None = None  # why the rewrite could not be a candidate
    rewards: list[float | None] | None = None  # of its validation rollouts, once finished

    @property
    def score(self) -> float | None:
        """Mean validation reward; a rollout that earned none (failed) counts as 0."""
        if not self.rewards:
            return None
        return sum(r or 0.0 for r in self.rewards) / len(self.rewards)


@dataclass
class Published:
    resources_id: str
    version: int
    cid: str
    resources: dict[str, Any]  # as published (JSON), so that a restart republishes the same


@dataclass
class ApoState:
    run_id: str  # the run name and a nonce: ids of rollouts and versions start with it
    prompt_name: str
    engine: str
    next_version: int
    carried: dict[str, Any]  # the other resources candidates run with (JSON)
    round: int = 0
    candidates: dict[str, Candidate] = field(default_factory=dict)
    critiques: dict[str, str] = field(default_factory=dict)  # "round:parent" -> critique
    batches: dict[str, str] = field(default_factory=dict)  # batch -> "queuing" | "queued"
    beam: list[str] = field(default_factory=list)
    published: list[Published] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)  # one summary per round
    tasks_digest: str = ""  # of the training and validation tasks the run was started with

    # -- candidates --------------------------------------------------------------------------

    def add_candidate(
        self, template: str, parent: str | None, rejected: str | None = None
    ) -> Candidate:
        cid = f"c{len(self.candidates)}"
        candidate = Candidate(
            cid=cid, template=template, parent=parent, round=self.round,
            version=self.next_version, resources_id=f"{self.run_id}-{cid}", rejected=rejected,
        )  # fmt: skip
        if rejected is None:
            self.next_version += 1  # a rejected rewrite is never published
        self.candidates[cid] = candidate
        return candidate

    def children(self, round_: int, parent: str) -> list[Candidate]:
        return [c for c in self.candidates.values() if c.round == round_ and c.parent == parent]

    def templates(self) -> set[str]:
        return {c.template for c in self.candidates.values()}

    def best(self) -> Candidate | None:
        return self.candidates[self.beam[0]] if self.beam else None

    # -- JSON ----------------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ApoState:
        raw = json.loads(text)
        raw["candidates"] = {k: Candidate(**v) for k, v in raw["candidates"].items()}
        raw["published"] = [Published(**p) for p in raw["published"]]
        return cls(**raw)


def tasks_digest(train: Sequence[Any], val: Sequence[Any]) -> str:
    """A hash of the task sets: batches are named by round and candidate, so a run resumed
    with other tasks would mix results of different tasks under one name."""
    text = json.dumps({"train": list(train), "val": list(val)}, sort_keys=True, default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def select_beam(candidates: Iterable[Candidate], width: int) -> list[str]:
    """The `width` best scored candidates, best first; ties go to the older candidate (a
    rewrite must measure better than what it would replace, not just as well)."""
    scored = [c for c in candidates if c.rejected is None and c.score is not None]
    scored.sort(key=lambda c: (-(c.score or 0.0), int(c.cid[1:])))
    return [c.cid for c in scored[:width]]


def sample_tasks(count: int, size: int, seed: int, round_: int, parent: str) -> list[int]:
    """Which training tasks a parent is run on in a round (all of them if there are few)."""
    if size >= count:
        return list(range(count))
    rng = random.Random(f"{seed}:{round_}:{parent}")
    return sorted(rng.sample(range(count), size))


def worst(results: Sequence[tuple[str, float | None]], count: int) -> list[str]:
    """The rollouts that went worst (failed ones first, then by reward), at most `count`."""
    ranked = sorted(results, key=lambda r: (r[1] is not None, r[1] or 0.0, r[0]))
    return [rollout_id for rollout_id, _ in ranked[:count]]
