"""The demo on a real pretrained model: SmolLM2-135M-Instruct learns arithmetic word problems
(word_problems.py) on the path a GPU user runs: runners and their gateways, `serve --engine
vllm` reloading each version in place, the trainer, resources versions, and a held-out set
evaluated as val rollouts.

The settings were chosen from measurements on the project's 2-core machine (the benchmark,
benchmarks/real_model.py, records them): a LoRA adapter of rank 16 on the model in bfloat16
(an update runs about twice as fast as in float32 on CPUs with AVX-512 bf16; a checkpoint is
a 0.2 MB adapter with its optimiser, not 1.6 GB), merged into the base by the policy server
and the layers it adapts reloaded into vLLM in place (vLLM's CPU build generates 3.5x slower
with an adapter on), 4
groups of 8 attempts a step at temperature 0.7, one pass, the trainer on both cores while
vLLM waits (on-policy).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agl_stream.demo.word_problems import HELDOUT_SIZE, MAX_TOKENS, TRAIN_TEMPERATURE, heldout
from agl_stream.demo.word_problems import tasks as word_problems
from agl_stream.launch.heldout import Evaluation
from agl_stream.launch.run import RunConfig

REAL_MODEL = "smollm2-135m-instruct"
AGENT = "agl_stream.demo.word_problems:solve"
WEIGHTS = ("lora", "full")


@dataclass(frozen=True)
class RealSettings:
    """What the real demo trains with (the defaults: the measured choice)."""

    model: str = REAL_MODEL
    weights: str = "lora"  # "lora": an adapter on the frozen base; "full": the whole model
    lora_rank: int = 16
    learning_rate: float | None = None  # None: 3e-4 for LoRA, 3e-5 for the whole model
    group_size: int = 8
    groups_per_step: int = 4
    trainer_threads: int = 2
    dtype: str = "bfloat16"
    eval_every: int = 10
    heldout_size: int = HELDOUT_SIZE
    keep: int = 3  # checkpoints kept (a whole-model step is 0.8 GB with its optimiser)
    # How vLLM serves each LoRA version: merged into the base, its adapted layers reloaded in
    # place (vLLM's CPU build answered 32 calls in 19.7 s with an adapter on, 5.4 s without),
    # or as an adapter.
    serve_lora: str = "merge"

    def __post_init__(self) -> None:
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {self.weights!r}")

    @property
    def lr(self) -> float:
        if self.learning_rate is not None:
            return self.learning_rate
        return 3e-4 if self.weights == "lora" else 3e-5

    @property
    def trainer_dtype(self) -> str:
        """A whole-model update keeps float32 weights: in bfloat16 (8 bits of mantissa) an
        update of 3e-5 of a weight rounds away. A LoRA adapter is float32 on either base."""
        return self.dtype if self.weights == "lora" else "float32"

    def trainer_args(self) -> tuple[str, ...]:
        args = [
            "--dtype", self.trainer_dtype, "--threads", str(self.trainer_threads), "--epochs", "1",
            "--temperature", str(TRAIN_TEMPERATURE), "--keep", str(self.keep),
            "--minibatch-size", str(self.group_size * self.groups_per_step),
        ]  # fmt: skip
        if self.weights == "lora":
            args += ["--lora-rank", str(self.lora_rank)]
        return tuple(args)

    def serve_args(self) -> tuple[str, ...]:
        # The prompt (~50 tokens with the chat template) and the answer fit in 256.
        args = ["--dtype", self.dtype, "--vllm-max-model-len", "256"]
        if self.weights == "lora" and self.serve_lora == "adapter":
            args += ["--vllm-max-lora-rank", str(self.lora_rank)]
        args += ["--vllm-lora", self.serve_lora]
        return (*args, "--vllm-args", "--max-num-seqs 64")


def real_config(settings: RealSettings, **demo: Any) -> RunConfig:
    """The RunConfig of the real demo; `demo` sets RunConfig's own fields (steps, seed,
    out_dir, dashboard_port, run_name, ...)."""
    items = heldout(settings.heldout_size)
    defaults: dict[str, Any] = {
        "groups_per_step": settings.groups_per_step,
        "group_size": settings.group_size,
        "learning_rate": settings.lr,
        "agent": AGENT,
        "task_source": word_problems,
        "engine": "vllm",
        "vllm_args": (),  # compiled: starts slower, generates faster over a long run
        "model": settings.model,
        "trainer_args": settings.trainer_args(),
        "serve_args": settings.serve_args(),
        "evaluation": Evaluation(items, every=settings.eval_every),
        "runners": 1,
        "concurrency": 64,
        "timeout_seconds": 300.0,
        "stall_seconds": 900.0,
    }
    return RunConfig(**{**defaults, **demo})


def training_prompts(seed: int, steps: int, groups_per_step: int) -> list[dict[str, Any]]:
    """The problems of every step in the order the demo's driver draws them (its rng is
    seeded with the demo's seed): what a baseline trained on the same prompts uses."""
    rng = random.Random(seed)
    return [item for _ in range(steps) for item in word_problems(rng, groups_per_step)]


def output_dir(config: RunConfig) -> Path:
    return config.out_dir / config.run_name


__all__ = ["MAX_TOKENS", "REAL_MODEL", "RealSettings", "real_config", "training_prompts"]
