"""The vLLM engine's tokenizer for each version: loaded once while its files stay the same
(a version after each step reloads weights, not a 49K-word tokenizer), loaded again when they
change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agl_stream.serving.checks import CheckpointRefused
from agl_stream.serving.vllm_engine import _tokenizer
from agl_stream.training.model import save_policy, tiny_policy


def test_a_tokenizer_is_reused_until_its_files_change(tmp_path: Path) -> None:
    base = tmp_path / "base"
    save_policy(tiny_policy(seed=1), base)
    adapter = tmp_path / "adapter"  # an adapter without a tokenizer of its own
    adapter.mkdir()
    first = _tokenizer(adapter, base)
    assert _tokenizer(adapter, base) is first
    assert _tokenizer(None, base) is first
    config = base / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": 77}))
    again = _tokenizer(None, base)
    assert again is not first and again.model_max_length == 77


def test_a_folder_without_a_tokenizer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointRefused, match="has no tokenizer"):
        _tokenizer(None, tmp_path)
