"""Checkpoints are checked before an engine is asked to serve them (vLLM crashes on a bad
reload and takes a mis-shaped adapter silently): each defect is refused with a sentence
naming it, and a good checkpoint passes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from agl_stream.serving.checks import (
    CPU_HEAD_SIZES,
    CheckpointRefused,
    check_adapter,
    check_model,
    model_shape,
    read_header,
)
from agl_stream.training.model import content_hash, initial_policy, save_policy


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    out = {}
    for spec in ("tiny-chat-h32", "tiny-chat", "tiny-h32"):
        save_policy(initial_policy(spec, seed=1), root / spec)
        out[spec] = root / spec
    return out


def copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_a_whole_model_passes_and_can_replace_one_of_its_shape(saved: dict[str, Path]) -> None:
    served = check_model(saved["tiny-chat-h32"], None, None, CPU_HEAD_SIZES)
    assert served.head_size == 32 and served.context == 256
    assert "model.embed_tokens.weight" in served.tensors
    again = check_model(
        saved["tiny-chat-h32"], content_hash(saved["tiny-chat-h32"]), served, CPU_HEAD_SIZES
    )
    assert again.tensors == served.tensors


def test_a_head_size_the_cpu_kernels_refuse(saved: dict[str, Path]) -> None:
    with pytest.raises(CheckpointRefused, match="attention heads of size 16; vLLM's CPU"):
        check_model(saved["tiny-chat"], None, None, CPU_HEAD_SIZES)
    assert check_model(saved["tiny-chat"], None, None, None).head_size == 16  # GPU: no limit


def test_a_hash_other_than_published(saved: dict[str, Path]) -> None:
    wrong = "sha256:" + "0" * 64
    with pytest.raises(CheckpointRefused, match=r"hashes to sha256:.*its resources version says"):
        check_model(saved["tiny-chat-h32"], wrong, None, None)


def test_another_architecture_cannot_replace_the_served_one(saved: dict[str, Path]) -> None:
    served = model_shape(saved["tiny-chat-h32"])
    with pytest.raises(CheckpointRefused, match=r"another architecture .*vocab_size 262 -> 9"):
        check_model(saved["tiny-h32"], None, served, None)


def test_a_truncated_weights_file(saved: dict[str, Path], tmp_path: Path) -> None:
    broken = copy(saved["tiny-chat-h32"], tmp_path / "broken")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CheckpointRefused, match="truncated or damaged"):
        check_model(broken, content_hash(broken), None, None)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"abc", "shorter than 8 bytes"),
        ((10**9).to_bytes(8, "little") + b"{}", "header too long"),
        ((4).to_bytes(8, "little") + b"nope", "unreadable safetensors header"),
        ((2).to_bytes(8, "little") + b"[]", "unreadable safetensors header"),
    ],
)
def test_files_that_are_not_safetensors(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    with pytest.raises(CheckpointRefused, match=message):
        read_header(path)


def test_missing_pieces(saved: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(CheckpointRefused, match="is not a directory"):
        check_model(tmp_path / "nowhere", None, None, None)
    no_config = copy(saved["tiny-chat-h32"], tmp_path / "no-config")
    (no_config / "config.json").unlink()
    with pytest.raises(CheckpointRefused, match=r"config.json is missing"):
        check_model(no_config, None, None, None)
    no_weights = copy(saved["tiny-chat-h32"], tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(CheckpointRefused, match=r"holds no \.safetensors weights"):
        check_model(no_weights, None, None, None)


def test_weights_of_another_shape_under_the_same_config(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    served = model_shape(saved["tiny-chat-h32"])
    odd = copy(saved["tiny-chat-h32"], tmp_path / "odd")
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, odd / "model.safetensors")
    lacks = r"lacks weights of the model served: model\.layers\.0\."
    with pytest.raises(CheckpointRefused, match=lacks):
        check_model(odd, None, served, None)


def adapter(directory: Path, tensors: dict[str, torch.Tensor], **config: object) -> Path:
    directory.mkdir()
    save_file(tensors, directory / "adapter_model.safetensors")
    (directory / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config})
    )
    return directory


def lora(module: str, rank: int, out_features: int, in_features: int) -> dict[str, torch.Tensor]:
    prefix = f"base_model.model.{module}"
    return {
        f"{prefix}.lora_A.weight": torch.zeros(rank, in_features),
        f"{prefix}.lora_B.weight": torch.zeros(out_features, rank),
    }


Q = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.1.mlp.down_proj"


def test_a_lora_adapter_that_fits_its_base(saved: dict[str, Path], tmp_path: Path) -> None:
    base = model_shape(saved["tiny-chat-h32"])
    good = adapter(tmp_path / "good", {**lora(Q, 4, 64, 64), **lora(DOWN, 4, 64, 128)})
    found = check_adapter(good, content_hash(good), base, 512)
    assert found.rank == 4 and found.modules == {f"{Q}.weight", f"{DOWN}.weight"}


@pytest.mark.parametrize(
    ("tensors", "config", "message"),
    [
        (lora(DOWN, 4, 64, 40), {}, r"has shape \[4, 40\], which does not fit"),
        (lora(Q, 4, 32, 64), {}, r"has shape \[32, 4\], which does not fit"),
        (lora("model.layers.7.mlp.up_proj", 4, 128, 64), {}, "which the base lacks"),
        (lora(Q, 8, 64, 64), {}, "LoRA rank 8, above the most, 4"),
        ({"base_model.model.x.weight": torch.zeros(2)}, {}, "is not a LoRA matrix"),
        ({}, {}, "holds no LoRA matrices"),
        (lora(Q, 4, 64, 64), {"peft_type": "IA3"}, "'IA3' adapter; only LoRA"),
        (lora(Q, 4, 64, 64), {"use_dora": True}, "uses use_dora"),
        (lora(Q, 4, 64, 64), {"modules_to_save": ["lm_head"]}, "uses modules_to_save"),
    ],
)
def test_adapters_vllm_would_serve_wrongly_or_not_at_all(
    saved: dict[str, Path], tmp_path: Path, tensors: dict[str, torch.Tensor],
    config: dict[str, object], message: str,
) -> None:  # fmt: skip
    base = model_shape(saved["tiny-chat-h32"])
    if not tensors:
        (tmp_path / "empty").mkdir()
        save_file({"x": torch.zeros(1)}, tmp_path / "empty" / "other.safetensors")
        directory = tmp_path / "empty"
        (directory / "adapter_config.json").write_text('{"peft_type": "LORA"}')
        save_file({}, directory / "adapter_model.safetensors")
    else:
        directory = adapter(tmp_path / "bad", tensors, **config)
    with pytest.raises(CheckpointRefused, match=message):
        check_adapter(directory, None, base, 4)
