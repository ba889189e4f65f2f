"""Checkpoint locations: a step's directory and its file URI name each other both ways."""

from __future__ import annotations

from pathlib import Path

from agl_stream.training.checkpoints import CheckpointStore


def test_a_step_is_found_from_its_uri_even_with_spaces_and_percents(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "runs 100%" / "ckpt"))
    uri = store.step_dir(3).as_uri()
    assert "%20" in uri and "%25" in uri  # as_uri() percent-encodes
    assert store.step_of(uri) == 3
    assert store.step_of(CheckpointStore(str(tmp_path / "other")).step_dir(3).as_uri()) is None
    assert store.step_of("s3://bucket/step-000003") is None
