"""Merged weights a vLLM server leaves behind (agl_stream.serving.vllm_engine): each is a whole
model, in memory under /dev/shm, so those of servers no longer running are removed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from agl_stream.serving.vllm_engine import MERGED_PREFIX, remove_orphans


def test_only_the_merged_weights_of_servers_no_longer_running_are_removed(
    tmp_path: Path,
) -> None:
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    dead = tmp_path / f"{MERGED_PREFIX}{ended.stdout.strip()}-abc123"
    alive = tmp_path / f"{MERGED_PREFIX}{os.getpid()}-def456"
    unnamed = tmp_path / f"{MERGED_PREFIX}ghi789"  # no owner in its name: left as it is
    other = tmp_path / "agl-other-1-x"
    for directory in (dead, alive, unnamed, other):
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(b"weights")
    assert remove_orphans(tmp_path) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (alive, unnamed, other)
    )
