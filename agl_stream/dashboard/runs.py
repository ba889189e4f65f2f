"""Training runs as the resources topic tells them (pure): the GRPO trainer publishes a
version per step with `run_name`, `step`, `mean_reward` and counts in its metadata (and
`policy`: several policies trained together are a run each, named <run_name>/<policy>); APO
publishes each best prompt with `apo_run`, `round` and `val_score`; the real demo publishes
each held-out evaluation (pin-only) with `heldout_run`, `heldout_step` and
`heldout_accuracy`, a run of its own (algorithm "heldout") beside the training run."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from itertools import pairwise
from typing import Any

from pydantic import BaseModel

from agl_stream.agent.llm import DEFAULT_POLICY
from agl_stream.queries.models import Resources

COUNTS = ("samples", "trajectories", "dropped_stale", "downweighted_stale", "dropped_incomplete")


class RunPoint(BaseModel):
    step: int  # GRPO: the step; APO: the round
    resources_id: str
    published_at: datetime
    # GRPO: the step's mean reward; APO: the best prompt's val score; heldout: the accuracy
    reward: float | None
    counts: dict[str, int]
    samples_per_second: float | None = None  # samples over the time since the previous point


class Run(BaseModel):
    name: str
    algorithm: str  # grpo | apo | heldout
    policy: str | None = None  # grpo: the policy trained
    versions: int
    first_published_at: datetime
    last_published_at: datetime
    latest_reward: float | None
    points: list[RunPoint]


def runs_from_versions(versions: Iterable[Resources]) -> list[Run]:
    """Every run among the versions, the most recently active first; points by step."""
    grouped: dict[tuple[str, str, str | None], list[RunPoint]] = {}
    for version in versions:
        found = _point(version)
        if found is not None:
            key, point = found
            grouped.setdefault(key, []).append(point)
    runs = []
    for (algorithm, name, policy), unordered in grouped.items():
        points = _with_throughput(sorted(unordered, key=lambda p: (p.step, p.published_at)))
        times = [p.published_at for p in points]
        rewards = [p.reward for p in points if p.reward is not None]
        runs.append(
            Run(
                name=name,
                algorithm=algorithm,
                policy=policy,
                versions=len(points),
                first_published_at=min(times),
                last_published_at=max(times),
                latest_reward=rewards[-1] if rewards else None,
                points=points,
            )
        )
    runs.sort(key=lambda r: r.last_published_at, reverse=True)
    return runs


def _with_throughput(points: list[RunPoint]) -> list[RunPoint]:
    out = points[:1]
    for before, point in pairwise(points):
        seconds = (point.published_at - before.published_at).total_seconds()
        samples = point.counts.get("samples")
        rate = samples / seconds if samples is not None and seconds > 0 else None
        out.append(point.model_copy(update={"samples_per_second": rate}))
    return out


def _point(version: Resources) -> tuple[tuple[str, str, str | None], RunPoint] | None:
    m = version.metadata
    key: tuple[str, str, str | None]
    if "run_name" in m and "step" in m:
        policy = m.get("policy", DEFAULT_POLICY)
        name = m["run_name"] if policy == DEFAULT_POLICY else f"{m['run_name']}/{policy}"
        key, step, reward = ("grpo", name, policy), m["step"], m.get("mean_reward")
    elif "apo_run" in m and "val_score" in m:
        key, step, reward = ("apo", m["apo_run"], None), m.get("round", "0"), m["val_score"]
    elif "heldout_run" in m and "heldout_accuracy" in m:
        key = ("heldout", m["heldout_run"], None)
        step, reward = m.get("heldout_step", "0"), m["heldout_accuracy"]
    else:
        return None
    counts = {k: int(m[k]) for k in COUNTS if _is_int(m.get(k))}
    point = RunPoint(
        step=int(step) if _is_int(step) else 0, resources_id=version.resources_id,
        published_at=version.published_at, reward=_float(reward), counts=counts,
    )  # fmt: skip
    return key, point


def _is_int(value: Any) -> bool:
    return isinstance(value, str) and value.lstrip("-").isdigit()


def _float(value: str | None) -> float | None:
    try:
        return None if value is None else float(value)
    except ValueError:
        return None
