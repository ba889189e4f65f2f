"""Checkpoint locations (a step's directory and its file URI name each other both ways) and
retention: which steps --keep deletes, and deleting them safely."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from agl_stream.events import (
    AttemptStarted,
    Checkpoint,
    RolloutFinished,
    RolloutMode,
    RolloutQueued,
    RolloutStatus,
)
from agl_stream.training.checkpoints import CheckpointStore, lineage_problems
from agl_stream.training.local_llm import load_checkpoint
from agl_stream.training.retention import InFlight, prunable


def test_a_step_is_found_from_its_uri_even_with_spaces_and_percents(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "runs 100%" / "ckpt"))
    uri = store.step_dir(3).as_uri()
    assert "%20" in uri and "%25" in uri  # as_uri() percent-encodes
    assert store.step_of(uri) == 3
    assert store.step_of(CheckpointStore(str(tmp_path / "other")).step_dir(3).as_uri()) is None
    assert store.step_of("s3://bucket/step-000003") is None


def _fake_step(store: CheckpointStore, step: int) -> None:
    def fill(directory: Path) -> None:
        (directory / "model.safetensors").write_bytes(b"weights %d" % step)

    store.write(step, fill, {"step": step})


def test_keep_the_last_n_and_the_live_ones() -> None:
    assert prunable(range(6), keep=2, live=[1]) == [0, 2, 3]
    assert prunable([0, 1], keep=5, live=[]) == []
    assert prunable([3, 4, 5], keep=1, live=[3, 4, 9]) == []  # a live step not here is no matter
    with pytest.raises(ValueError, match="--keep must be at least 1"):
        prunable([1], keep=0, live=[])


def test_a_prune_killed_midway_leaves_no_half_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step being pruned leaves the step names before any of its files go: a trainer
    killed mid-prune (here: removing fails after the rename) leaves a directory no reader
    takes for a checkpoint, and the next start removes it."""
    store = CheckpointStore(str(tmp_path / "ckpt"))
    for step in range(4):
        _fake_step(store, step)
    uri = store.step_dir(1).as_uri()
    real_rmtree = shutil.rmtree

    def killed(path: object, *args: object, **kwargs: object) -> None:
        next(iter(Path(str(path)).iterdir())).unlink()  # some files gone, then the kill
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        store.prune([1, 2])
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    assert store.steps() == [0, 2, 3]  # step 2 untouched, step 1 gone as a checkpoint
    assert not store.step_dir(1).exists()
    # A reader following the old URI finds nothing, not half a checkpoint.
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(Checkpoint(uri=uri, content_hash="sha256:" + "0" * 64))
    assert list(store.root.glob("step-000001.pruned-*"))
    store.clean_partial()
    assert sorted(p.name for p in store.root.iterdir()) == [
        "step-000000", "step-000002", "step-000003",
    ]  # fmt: skip
    store.prune([0, 2])
    assert store.steps() == [3]


def test_versions_named_by_rollouts_in_flight() -> None:
    flight = InFlight()
    flight.add(("tasks", 0), 0, _queued("r1", "v1"))
    flight.add(("tasks", 0), 1, _queued("r2", None))  # pins nothing: runs on the latest
    flight.add(("rollouts", 0), 0, _started("r2", "v2"))
    assert flight.versions() == {"v1", "v2"}
    flight.add(("rollouts", 0), 1, _finished("r2"))
    assert flight.versions() == {"v1"}
    # A retry's RolloutQueued read after the rollout's end (topics interleave) is no rollout.
    flight.add(("tasks", 0), 2, _queued("r2", "v2"))
    assert flight.versions() == {"v1"}
    # Resumed from its memory, it skips what it had folded and folds the rest once.
    again = InFlight.resume(json.loads(json.dumps(flight.memory())))
    again.add(("tasks", 0), 0, _queued("r9", "v9"))  # below what was read: folded before
    again.add(("rollouts", 0), 2, _finished("r1"))
    assert again.versions() == set()
    assert again.read_to == {("tasks", 0): 3, ("rollouts", 0): 3}


def _queued(rollout_id: str, pin: str | None) -> RolloutQueued:
    return RolloutQueued(
        rollout_id=rollout_id, attempt_number=1, input_json="{}", mode=RolloutMode.TRAIN,
        resources_id=pin,
    )  # fmt: skip


def _started(rollout_id: str, version: str) -> AttemptStarted:
    return AttemptStarted(
        rollout_id=rollout_id, attempt_id="a", attempt_number=1, worker_id="w",
        resources_id=version,
    )  # fmt: skip


def _finished(rollout_id: str) -> RolloutFinished:
    return RolloutFinished(rollout_id=rollout_id, status=RolloutStatus.SUCCEEDED, attempt_count=1)


def test_the_lineage_of_the_steps_kept_skips_pruned_gaps() -> None:
    def state(step: int, start: int, end: int) -> dict[str, object]:
        return {"step": step, "cut": {"spans:0": end}, "consumed": {"spans:0": [start, end]}}

    # Steps 2 and 3 pruned: step 4 is checked against its own cut, not step 1's.
    assert lineage_problems([state(1, 0, 5), state(4, 9, 12)]) == []
    # Consecutive steps are still held to the previous cut.
    (problem,) = lineage_problems([state(1, 0, 5), state(2, 6, 9)])
    assert "starts at 6, step 1 ended at 5" in problem
