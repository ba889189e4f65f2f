"""LoRA adapters (peft) on a frozen base: how the trainer builds one, and how a saved
adapter is put back on its base, to train on (the trainer's resume) or merged into it (the
policy server and the in-process sampler).

An adapter checkpoint is PEFT's standard directory (adapter_config.json and
adapter_model.safetensors), which vLLM loads as a LoRA adapter too; the base lives apart,
named by the Checkpoint's base_uri and pinned by its base_content_hash.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agl_stream.runtime.config import ConfigError
from agl_stream.training.hf import Policy, peft_calls

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ALL_LINEAR = "all-linear"  # peft's name for every linear layer but the output head


@dataclass(frozen=True)
class LoraSettings:
    """What `--lora-rank`, `--lora-alpha`, `--lora-dropout`, `--lora-target-modules` or
    `--lora-config FILE` ask for."""

    rank: int = 8
    alpha: float | None = None  # default: twice the rank
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    config_file: Path | None = None  # a LoraConfig as JSON (adapter_config.json's keys)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"--lora-rank must be at least 1, got {self.rank}")
        if self.alpha is not None and self.alpha <= 0:
            raise ValueError(f"--lora-alpha must be positive, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("--lora-target-modules names no module")

    def peft_config(self) -> Any:
        """peft's LoraConfig (from the file, when one is given)."""
        from peft import LoraConfig

        if self.config_file is not None:
            return _config_from_file(self.config_file)
        targets: str | list[str] = (
            ALL_LINEAR if self.target_modules == (ALL_LINEAR,) else list(self.target_modules)
        )
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha if self.alpha is not None else 2 * self.rank,
            lora_dropout=self.dropout,
            target_modules=targets,
            task_type="CAUSAL_LM",
        )


def _config_from_file(path: Path) -> Any:
    from peft import LoraConfig

    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--lora-config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--lora-config {path}: expected a JSON object of LoraConfig fields")
    data.pop("peft_type", None)
    known = {f.name for f in dataclasses.fields(LoraConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"--lora-config {path}: LoraConfig has no field(s) {', '.join(unknown)}")
    data.setdefault("task_type", "CAUSAL_LM")
    return LoraConfig(**data)


def with_adapter(policy: Policy, settings: LoraSettings) -> Policy:
    """A fresh adapter on `policy`'s model, whose own weights are frozen."""
    from peft import get_peft_model

    config = settings.peft_config()
    try:
        with peft_calls():
            model = get_peft_model(policy.model, config)
    except ValueError as exc:
        modules = config.target_modules
        raise ConfigError(f"Invalid setting --lora-target-modules {modules!r}: {exc}") from None
    return Policy(model, policy.tokenizer)


def load_adapter(base: Policy, directory: Path, trainable: bool) -> Policy:
    """The adapter saved in `directory` on `base` (to go on training it, or to serve)."""
    from peft import PeftModel

    if not (directory / ADAPTER_CONFIG).is_file():
        raise ValueError(f"{directory} is not a LoRA adapter (no {ADAPTER_CONFIG})")
    with peft_calls():
        model = PeftModel.from_pretrained(base.model, directory, is_trainable=trainable)
    return Policy(model, base.tokenizer)


def merged(base: Policy, directory: Path) -> Policy:
    """`base` with the adapter in `directory` merged into its weights: a plain model that
    generates as fast as the base (for serving; the base object is changed)."""
    adapted = load_adapter(base, directory, trainable=False)
    with peft_calls():
        return Policy(adapted.model.merge_and_unload(), base.tokenizer)


# Adapter weight names as peft saves them: base_model.model.<module>.lora_{A,B}.weight.
_PEFT_PREFIX = "base_model.model."
_LORA_A, _LORA_B = ".lora_A.weight", ".lora_B.weight"


def merged_linear_weights(
    base_dir: Path, adapter_dir: Path, dtype: Any | None = None
) -> dict[str, Any] | None:
    """Only the weights an adapter of linear layers changes, merged into its base:
    W + (alpha / r) * B @ A for each adapted layer, named as the base names them, in `dtype`
    (default: the base's). A few hundred milliseconds and a fraction of the model, where
    peft's whole merge loads, merges and saves everything: an engine that reloads weights
    in place (vLLM) takes these and keeps the rest. None when the adapter holds anything
    else (embedding LoRA, modules saved whole, DoRA, rsLoRA, fan-in-fan-out layers): peft's
    merge handles those."""
    import torch
    from safetensors import safe_open

    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    unusual = (
        config.get("use_dora") or config.get("use_rslora") or config.get("fan_in_fan_out")
        or config.get("modules_to_save") or config.get("rank_pattern")
        or config.get("alpha_pattern")
    )  # fmt: skip
    if unusual:
        return None
    scale = float(config["lora_alpha"]) / float(config["r"])
    with safe_open(adapter_dir / ADAPTER_WEIGHTS, "pt") as adapter:
        names = list(adapter.keys())
        pairs = {}
        for name in names:
            if not (name.startswith(_PEFT_PREFIX) and name.endswith((_LORA_A, _LORA_B))):
                return None
            if name.endswith(_LORA_A):
                module = name[len(_PEFT_PREFIX) : -len(_LORA_A)]
                pairs[module] = (adapter.get_tensor(name), adapter.get_tensor(
                    f"{_PEFT_PREFIX}{module}{_LORA_B}"
                ))  # fmt: skip
    if 2 * len(pairs) != len(names):
        return None
    wanted = {f"{module}.weight": module for module in pairs}
    out: dict[str, Any] = {}
    # Each base file opened once (opening it for every layer took ten times the merge).
    for file in sorted(base_dir.glob("*.safetensors")):
        with safe_open(file, "pt") as base:
            for name in wanted.keys() & set(base.keys()):
                weight = base.get_tensor(name)
                a, b = pairs[wanted[name]]
                merged_weight = torch.addmm(weight.float(), b.float(), a.float(), alpha=scale)
                out[name] = merged_weight.to(dtype or weight.dtype).contiguous()
    if out.keys() != wanted.keys():
        return None  # an adapted layer the base does not hold
    return out if out else None
