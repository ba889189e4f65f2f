"""LoRA adapters with peft on the tiny model: only the adapter trains and is saved (PEFT's
layout, hashed alone), a published "peft" checkpoint loads merged onto its base with both
hashes checked, and bad settings are refused with a sentence."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from agl_stream.events import Checkpoint
from agl_stream.runtime.config import ConfigError
from agl_stream.training.batching import TrainSample
from agl_stream.training.grpo import GRPO, GRPOConfig
from agl_stream.training.local_llm import CheckpointMismatch, load_checkpoint
from agl_stream.training.lora import (
    LoraSettings,
    load_adapter,
    merged,
    merged_linear_weights,
    with_adapter,
)
from agl_stream.training.model import content_hash, load_policy, save_policy, tiny_policy
from agl_stream.training.sampling import token_batch, token_logprobs

PROMPT, GOOD, BAD = (1, 6), (6, 6), (4, 5)
SAMPLES = [
    TrainSample(("r", "a"), PROMPT, GOOD, 1.0, 1.0, 1.0, None),
    TrainSample(("r", "b"), PROMPT, BAD, 0.0, -1.0, 1.0, None),
]


def logprobs(model: object) -> torch.Tensor:
    batch = token_batch([PROMPT, PROMPT], [GOOD, BAD], pad_id=0)
    with torch.no_grad():
        return token_logprobs(model, batch) * batch.response_mask


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A base model saved to base/, and an adapter trained on it saved to adapter/."""
    root = tmp_path_factory.mktemp("lora")
    base = tiny_policy(seed=3)
    save_policy(base, root / "base")
    adapted = with_adapter(base, LoraSettings(rank=4))
    GRPO(adapted.model, 0, GRPOConfig(learning_rate=1e-2, epochs=3)).update(SAMPLES)
    save_policy(adapted, root / "adapter")
    return root / "base", root / "adapter"


def test_only_the_adapter_trains_and_is_saved(tmp_path: Path) -> None:
    base = tiny_policy(seed=3)
    frozen = {k: v.clone() for k, v in base.model.state_dict().items()}
    adapted = with_adapter(base, LoraSettings(rank=4, target_modules=("q_proj", "v_proj")))
    GRPO(adapted.model, 0, GRPOConfig(learning_rate=5e-2)).update(SAMPLES)
    base_weights = adapted.model.get_base_model().state_dict()
    for name, value in frozen.items():  # the base's own weights are where they were
        lora_name = name.replace("q_proj.weight", "q_proj.base_layer.weight").replace(
            "v_proj.weight", "v_proj.base_layer.weight"
        )
        assert torch.equal(base_weights[lora_name], value), name
    save_policy(adapted, tmp_path / "adapter")
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert not any(name.startswith("model") or name.startswith("tokenizer") for name in files)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    # The hash covers the adapter's bytes only: small to write, small to hash.
    weights = (tmp_path / "adapter" / "adapter_model.safetensors").stat().st_size
    assert weights < 64 * 1024
    assert content_hash(tmp_path / "adapter").startswith("sha256:")


def test_a_peft_checkpoint_loads_merged_onto_its_base(trained: tuple[Path, Path]) -> None:
    base_dir, adapter_dir = trained
    checkpoint = Checkpoint(
        uri=adapter_dir.as_uri(), content_hash=content_hash(adapter_dir), format="peft",
        base_uri=base_dir.as_uri(), base_content_hash=content_hash(base_dir),
    )  # fmt: skip
    served = load_checkpoint(checkpoint)
    assert not hasattr(served.model, "peft_config")  # merged: a plain model
    adapter = load_adapter(load_policy(base_dir), adapter_dir, trainable=False)
    base = load_policy(base_dir)
    torch.testing.assert_close(logprobs(served.model), logprobs(adapter.model), atol=1e-5, rtol=0)
    assert not torch.allclose(logprobs(served.model), logprobs(base.model), atol=1e-3)
    # The adapter learned: the rewarded answer is likelier than on the base.
    assert logprobs(served.model)[0].sum() > logprobs(base.model)[0].sum()


def test_a_peft_checkpoint_with_a_wrong_or_missing_base_is_refused(
    trained: tuple[Path, Path],
) -> None:
    base_dir, adapter_dir = trained
    adapter_hash = content_hash(adapter_dir)
    wrong = Checkpoint(
        uri=adapter_dir.as_uri(), content_hash=adapter_hash, format="peft",
        base_uri=base_dir.as_uri(), base_content_hash="sha256:" + "0" * 64,
    )  # fmt: skip
    with pytest.raises(CheckpointMismatch, match=r"base.*hashes to sha256:"):
        load_checkpoint(wrong)
    baseless = Checkpoint(uri=adapter_dir.as_uri(), content_hash=adapter_hash, format="peft")
    with pytest.raises(CheckpointMismatch, match="names no base model"):
        load_checkpoint(baseless)
    other = Checkpoint(uri=adapter_dir.as_uri(), content_hash=adapter_hash, format="gguf")
    with pytest.raises(ValueError, match="format 'gguf'"):
        load_checkpoint(other)


def test_bad_lora_settings_are_refused_with_a_sentence(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--lora-rank must be at least 1"):
        LoraSettings(rank=0)
    with pytest.raises(ValueError, match="--lora-dropout"):
        LoraSettings(dropout=1.0)
    with pytest.raises(ConfigError, match="--lora-target-modules"):
        with_adapter(tiny_policy(), LoraSettings(target_modules=("no_such_proj",)))
    config = tmp_path / "lora.json"
    config.write_text(json.dumps({"r": 2, "lora_alpha": 4, "rank_dropout": 0.1}))
    with pytest.raises(ValueError, match="LoraConfig has no field"):
        LoraSettings(config_file=config).peft_config()
    config.write_text(json.dumps({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}))
    adapted = with_adapter(tiny_policy(), LoraSettings(config_file=config))
    assert adapted.model.peft_config["default"].r == 2


def test_the_weights_an_adapter_changes_merge_as_peft_merges_them(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    """What the vLLM engine reloads for a merged version: only the adapted layers, equal to
    those of peft's whole merge; the base's other weights are left as they are."""
    base_dir, adapter_dir = trained
    changed = merged_linear_weights(base_dir, adapter_dir)
    assert changed is not None
    whole = merged(load_policy(base_dir), adapter_dir).model.state_dict()
    base = load_policy(base_dir).model.state_dict()
    adapted = {name for name in base if not torch.equal(base[name], whole[name])}
    assert adapted and set(changed) >= adapted
    assert not any("embed" in name or "norm" in name for name in changed)
    for name, weight in changed.items():
        torch.testing.assert_close(weight, whole[name], atol=1e-6, rtol=0)
    half = merged_linear_weights(base_dir, adapter_dir, torch.bfloat16)
    assert half is not None and {w.dtype for w in half.values()} == {torch.bfloat16}
    # An adapter peft's merge must handle (here rsLoRA's scale) is left to it.
    unusual = tmp_path / "rslora"
    shutil.copytree(adapter_dir, unusual)
    config = json.loads((unusual / "adapter_config.json").read_text())
    (unusual / "adapter_config.json").write_text(json.dumps({**config, "use_rslora": True}))
    assert merged_linear_weights(base_dir, unusual) is None
