"""The trainer's update step and the torch engine's generation on a CUDA GPU, at the sizes of
real checkpoints: what `--device cuda --dtype bfloat16 --micro-batch-tokens N
--gradient-checkpointing` (and `--lora-rank R`) cost in time and GPU memory.

The models have Qwen2.5's shapes (hidden size, layers, heads, vocabulary) built from their
config with random weights: no checkpoint can be fetched on the GPU machines this project is
lent, and neither the time nor the memory of a step depends on the weights' values. Each case
runs one step to warm up and times the next ones (CUDA synchronised), with the code the trainer
runs (`GRPO.update`, `with_adapter`, `sampling.sample`, the policy server's `generate`).

    python -m benchmarks.gpu_training                 # every case (needs a GPU)
    python -m benchmarks.gpu_training --cases tiny --device cpu   # the script itself, anywhere
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from agl_stream.serving.engine import Job, generate
from agl_stream.training.batching import TrainSample
from agl_stream.training.device import Placement
from agl_stream.training.grpo import GRPO, GRPOConfig
from agl_stream.training.hf import Policy
from agl_stream.training.lora import LoraSettings, with_adapter
from agl_stream.training.model import tiny_policy
from agl_stream.training.sampling import sample

# Qwen2.5's published configs (config.json of Qwen/Qwen2.5-{0.5B,1.5B,7B}-Instruct).
QWEN = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       tie_word_embeddings=False),
}  # fmt: skip


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # "tiny" or a key of QWEN
    lora_rank: int | None  # None: the whole model trains
    samples: int  # one step's batch
    prompt_tokens: int
    response_tokens: int
    micro_batch_tokens: int


CASES = {
    case.name: case
    for case in [
        Case("tiny", "tiny", None, 64, 24, 16, 4096),
        Case("0.5b-whole", "qwen2.5-0.5b", None, 64, 256, 256, 16384),
        Case("1.5b-whole", "qwen2.5-1.5b", None, 64, 256, 256, 16384),
        Case("7b-lora16", "qwen2.5-7b", 16, 64, 256, 256, 16384),
        Case("7b-lora16-mb4k", "qwen2.5-7b", 16, 64, 256, 256, 4096),
        Case("7b-whole", "qwen2.5-7b", None, 64, 256, 256, 16384),
    ]
}


@dataclass
class Result:
    case: str
    parameters_m: float
    trainable_m: float
    step_s: float  # median of the timed steps
    samples_per_s: float
    train_tokens_per_s: float  # prompt + response tokens through forward and backward
    peak_gib: float  # torch.cuda.max_memory_allocated over the steps (0 on the CPU)
    sample_tokens_per_s: float  # sampling.sample: one sequence, token by token
    engine_tokens_per_s: float  # the policy server's generate: 32 prompts in one batch


def build(case: Case, where: Placement) -> Policy:
    if case.model == "tiny":
        policy = tiny_policy(seed=0)
        policy.model.to(device=where.device, dtype=where.torch_dtype)
    else:
        from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

        del AutoTokenizer  # the update and generation need token ids only
        config = Qwen2Config(**QWEN[case.model], max_position_embeddings=4096)
        before = torch.get_default_dtype()
        torch.set_default_dtype(where.torch_dtype)  # built in its dtype, not float32 first
        try:
            with torch.device(where.device):
                model = Qwen2ForCausalLM(config)
        finally:
            torch.set_default_dtype(before)
        policy = Policy(model, None)
    if case.lora_rank is not None:
        policy = with_adapter(policy, LoraSettings(rank=case.lora_rank))
    return policy


def batch(case: Case, vocab: int, rng: random.Random) -> list[TrainSample]:
    samples = []
    for i in range(case.samples):
        prompt = tuple(rng.randrange(3, vocab) for _ in range(case.prompt_tokens))
        response = tuple(rng.randrange(3, vocab) for _ in range(case.response_tokens))
        advantage = 1.0 if i % 2 else -1.0
        samples.append(TrainSample(("r", str(i)), prompt, response, advantage, advantage, 1.0,
                                   None))  # fmt: skip
    return samples


def synchronize(where: Placement) -> None:
    if where.device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_steps(case: Case, policy: Policy, where: Placement, steps: int) -> list[float]:
    config = GRPOConfig(
        learning_rate=1e-6,
        epochs=1,
        minibatch_size=case.samples,
        micro_batch_tokens=case.micro_batch_tokens,
        gradient_checkpointing=case.model != "tiny",
    )
    grpo = GRPO(policy.model, 0, config)
    vocab = policy.model.config.vocab_size
    rng = random.Random(0)
    times = []
    for _ in range(steps + 1):  # the first warms up
        samples = batch(case, vocab, rng)
        synchronize(where)
        start = time.perf_counter()
        grpo.update(samples)
        synchronize(where)
        times.append(time.perf_counter() - start)
    return times[1:]


def sampling_rate(policy: Policy, where: Placement, tokens: int) -> float:
    """The second of two identical calls: the first meets every shape (each new length of the
    KV cache) for the first time, which on a GPU costs more than the call itself."""
    model = policy.model.eval()
    vocab = model.config.vocab_size
    prompt = [3 + i % (vocab - 3) for i in range(64)]
    rate = 0.0
    for _ in range(2):
        generator = torch.Generator().manual_seed(0)
        synchronize(where)
        start = time.perf_counter()
        completion = sample(model, prompt, tokens, generator=generator)
        synchronize(where)
        rate = len(completion.token_ids) / (time.perf_counter() - start)
    return rate


def engine_rate(policy: Policy, where: Placement, tokens: int) -> float:
    """The policy server's batched generate, 32 prompts of 64 to 95 tokens; the second of two
    identical calls, as above."""
    vocab = policy.model.config.vocab_size
    prompts = [[3 + j % (vocab - 3) for j in range(64 + i)] for i in range(32)]
    rate = 0.0
    for _ in range(2):
        jobs = [Job(p, tokens, 1.0, i, lambda t, lp: None) for i, p in enumerate(prompts)]
        synchronize(where)
        start = time.perf_counter()
        generate(policy.model.eval(), jobs, pad_id=0, eos_id=None)
        synchronize(where)
        rate = sum(len(job.token_ids) for job in jobs) / (time.perf_counter() - start)
    return rate


def run(case: Case, where: Placement, steps: int) -> Result:
    on_gpu = where.device.startswith("cuda")
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    policy = build(case, where)
    params = sum(p.numel() for p in policy.model.parameters())
    trainable = sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
    times = timed_steps(case, policy, where, steps)
    peak = torch.cuda.max_memory_allocated() / 2**30 if on_gpu else 0.0
    step = sorted(times)[len(times) // 2]
    tokens = case.samples * (case.prompt_tokens + case.response_tokens)
    result = Result(
        case=case.name,
        parameters_m=round(params / 1e6, 2),
        trainable_m=round(trainable / 1e6, 2),
        step_s=round(step, 3),
        samples_per_s=round(case.samples / step, 1),
        train_tokens_per_s=round(tokens / step),
        peak_gib=round(peak, 2),
        sample_tokens_per_s=round(sampling_rate(policy, where, 64), 1),
        engine_tokens_per_s=round(engine_rate(policy, where, 64), 1),
    )
    del policy
    gc.collect()
    return result


def table(results: list[Result]) -> str:
    lines = [
        "| case | parameters (M) | trainable (M) | step (s) | samples/s | train tokens/s "
        "| peak GPU memory (GiB) | sample tokens/s | engine tokens/s (32 prompts) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.case} | {r.parameters_m:,} | {r.trainable_m:,} | {r.step_s} "
            f"| {r.samples_per_s} | {r.train_tokens_per_s:,} | {r.peak_gib} "
            f"| {r.sample_tokens_per_s} | {r.engine_tokens_per_s} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES)
    )
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    unknown = [name for name in args.cases.split(",") if name not in CASES]
    if unknown:
        parser.error(f"--cases: no case named {', '.join(unknown)}; known: {', '.join(CASES)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here; use --device cpu")
    where = Placement(args.device, "bfloat16" if args.device.startswith("cuda") else "float32")
    about: dict[str, Any] = {"torch": torch.__version__, "device": args.device}
    if where.device.startswith("cuda"):
        about["gpu"] = torch.cuda.get_device_name(where.device)
    import transformers

    about["transformers"] = transformers.__version__
    print(json.dumps(about), flush=True)
    results = []
    for name in args.cases.split(","):
        result = run(CASES[name], where, args.steps)
        print(json.dumps(asdict(result)), flush=True)
        results.append(result)
    print(table(results))
    if args.json_out:
        args.json_out.write_text(
            json.dumps({"about": about, "results": [asdict(r) for r in results]}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
