"""A trainer under a staleness bound judges a step's samples by the versions they ran on: a
version its resources follower has not folded yet (the runner saw it first) is waited for,
not judged unknown (hence too stale); one that never comes is waited for a bounded time."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agl_stream.events import AttemptStatus, Checkpoint, ResourcesPublished
from agl_stream.runtime.config import KafkaSettings
from agl_stream.training import trainer as trainer_module
from agl_stream.training.batching import Staleness
from agl_stream.training.trainer import Trainer, TrainerConfig
from agl_stream.training.trajectories import Trajectory

HASH = "sha256:" + "0" * 64


def ran_on(resources_id: str, n: int) -> Trajectory:
    return Trajectory(
        rollout_id=f"r{n}", attempt_id="a", attempt_number=1, input_json="{}",
        metadata={"group": "g"}, resources_id=resources_id, status=AttemptStatus.SUCCEEDED,
        reward=1.0, spans=(),
    )  # fmt: skip


def trainer(tmp_path: Path) -> Trainer:
    config = TrainerConfig(
        checkpoint_dir=str(tmp_path), group_size=2, groups_per_step=1,
        staleness=Staleness(max_versions=1),
    )  # fmt: skip
    made = Trainer(KafkaSettings(), config)
    made.groups.add([ran_on("late-v1", 1), ran_on("late-v1", 2)])
    assert made.groups.ready()
    return made


async def test_a_step_waits_for_the_version_its_samples_ran_on(tmp_path: Path) -> None:
    made = trainer(tmp_path)
    waiting = asyncio.create_task(made._versions_folded())
    await asyncio.sleep(0)  # it looked, found late-v1 missing and waits for a change
    assert not waiting.done() and made.counts["version_fold_waits"] == 1
    checkpoint = Checkpoint(uri=(tmp_path / "step-000001").as_uri(), content_hash=HASH)
    made.resources.apply(
        ResourcesPublished(resources_id="late-v1", version=1, resources={"policy": checkpoint})
    )
    await asyncio.wait_for(waiting, 5)
    assert made.versions == {"late-v1": 1}  # judged by its step, not as unknown


async def test_a_version_that_never_comes_is_waited_for_a_bounded_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = trainer(tmp_path)
    monkeypatch.setattr(trainer_module, "VERSION_FOLD_WAIT", 0.05)
    await asyncio.wait_for(made._versions_folded(), 5)
    assert made.versions == {}  # unknown: the staleness rule drops it, as before


async def test_without_a_bound_nothing_waits(tmp_path: Path) -> None:
    made = trainer(tmp_path)
    made.config.staleness = Staleness()
    await asyncio.wait_for(made._versions_folded(), 1)
    assert made.counts["version_fold_waits"] == 0
