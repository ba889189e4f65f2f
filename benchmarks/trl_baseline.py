"""The baseline the demo is measured against: the demo's task and tiny model trained with
Hugging Face TRL's `GRPOTrainer`, in one process on the CPU.

    .venv/bin/pip install -e '.[bench]'   # TRL: a benchmark-only dependency (`make trl-baseline`)
    .venv/bin/python -m benchmarks.trl_baseline --steps 30 --json-out benchmarks/trl_baseline.json

The same task and model as `agl-stream demo` (and benchmarks.step_latency): prompts
`<bos> {letter}` drawn by agl_stream.demo.task.tasks from the demo's seed, so step n's eight
letters are the demo's (TRL's sampler is not shuffled), rewarded by agl_stream.demo.task.score;
initial_policy("tiny", seed) and its tokenizer; one torch thread, as the trainer runs. The
update matches agl_stream.training.grpo's defaults in TRL's names: a step is one generation
batch of --groups-per-step prompts x --group-size completions (8 x 8) of at most ANSWER_WORDS
tokens at temperature 1, trained on in minibatches of 32 (steps_per_generation 2), two passes
(num_iterations 2, so four optimizer steps per step), PPO clip 0.2, no KL (beta 0), lr 3e-3
constant, AdamW weight decay 0.01 (torch's default, which ours uses), grad norm 1, rewards
scaled by the group's std, loss averaged per sequence (loss_type "grpo"). Nothing is saved
or reported (report_to none).

Measured: the reward by wrapping the reward function (TRL calls it once per step with the
step's completions: their mean is the step's mean reward); time by a TrainerCallback (the
clock starts at on_train_begin; a step ends at the on_step_end of its last optimizer step;
sampling is the step's start to its rewards being scored, update the rest). Figures: the
median step, sampling and update seconds (the first step, which includes warm-up, left out),
the mean reward of the first and last steps and of their first and last tenths, the seconds
from the start of training to the end of the first step whose mean reward >= 0.9 (None if
none), completions per second over the training wall time, and the training and total wall
seconds (total adds importing TRL and building the model and the trainer).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console

from agl_stream.demo.task import ANSWER_WORDS, LETTERS, score, tasks
from agl_stream.launch.run import RunConfig
from agl_stream.training.grpo import GRPOConfig as OurGRPO
from agl_stream.training.hf import quiet_transformers
from agl_stream.training.model import initial_policy, set_threads
from benchmarks.stack import benchmark_parser, key_value_table, run_benchmark

console = Console()
TARGET_REWARD = 0.9


@dataclass
class Clock:
    """What the reward function and the callback record, step by step."""

    updates_per_step: int
    began: float = 0.0
    starts: list[float] = field(default_factory=list)
    scored: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)

    def reward(self, completions: list[str], letter: list[str], **_: Any) -> list[float]:
        """The demo's score of each completion (TRL passes the dataset's columns)."""
        scores = [score(want, said) for want, said in zip(letter, completions, strict=True)]
        self.scored.append(time.monotonic())
        self.rewards.append(sum(scores) / len(scores))
        return scores


def train(args: argparse.Namespace) -> dict[str, Any]:
    began = time.monotonic()
    quiet_transformers()  # before transformers is imported: offline, no progress bars
    try:
        from datasets import Dataset
        from transformers import PrinterCallback, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as error:
        hint = "TRL is a benchmark-only extra: pip install -e '.[bench]'"
        raise SystemExit(f"{error}: {hint}") from error
    policy = initial_policy("tiny", args.seed)
    set_threads(1)

    ours = OurGRPO()
    batch = args.groups_per_step * args.group_size
    if batch % ours.minibatch_size:
        raise SystemExit(f"{batch} completions a step: not minibatches of {ours.minibatch_size}")
    clock = Clock(updates_per_step=ours.epochs * batch // ours.minibatch_size)

    class Timer(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, *_: Any, **__: Any) -> None:
            clock.began = time.monotonic()
            clock.starts.append(clock.began)

        def on_step_end(self, _: Any, state: Any, *__: Any, **___: Any) -> None:
            if state.global_step % clock.updates_per_step == 0:
                clock.ends.append(time.monotonic())
                clock.starts.append(clock.ends[-1])

    # transformers 5's renames (gradient_checkpointing...), which TRL 1.16 still calls
    warnings.filterwarnings("ignore", "`.*` is deprecated and will be removed in v6", FutureWarning)
    rng = random.Random(args.seed)  # the demo's draw: tasks(rng, groups_per_step) per step
    letters = [t["letter"] for _ in range(args.steps) for t in tasks(rng, args.groups_per_step)]
    assert set(letters) <= set(LETTERS)
    dataset = Dataset.from_dict({"prompt": [f"<bos> {x}" for x in letters], "letter": letters})
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="agl-bench-trl-"), save_strategy="no",
        report_to="none", logging_strategy="no", disable_tqdm=True, use_cpu=True,
        seed=args.seed, data_seed=args.seed, shuffle_dataset=False,
        max_steps=args.steps * clock.updates_per_step,
        per_device_train_batch_size=ours.minibatch_size, gradient_accumulation_steps=1,
        steps_per_generation=batch // ours.minibatch_size, num_generations=args.group_size,
        num_iterations=ours.epochs, max_completion_length=ANSWER_WORDS,
        temperature=ours.temperature, top_p=1.0, top_k=0,
        learning_rate=args.learning_rate, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.01, max_grad_norm=ours.max_grad_norm,
        beta=0.0, epsilon=ours.clip_epsilon, loss_type="grpo",
        scale_rewards="group" if ours.scale_rewards else "none",
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=policy.model, reward_funcs=[clock.reward], args=config, train_dataset=dataset,
        processing_class=policy.tokenizer, callbacks=[Timer()],
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # its summary of the run: the table says it
    trainer.train()
    ended = time.monotonic()
    return figures(args, clock, batch, ended - clock.began, ended - began)


def figures(
    args: argparse.Namespace, clock: Clock, batch: int, training_s: float, total_s: float
) -> dict[str, Any]:
    steps = len(clock.ends)
    if steps != args.steps or len(clock.rewards) != steps:
        raise RuntimeError(f"{steps} steps ended and {len(clock.rewards)} were scored")
    starts = clock.starts[:steps]
    step_s = [end - start for start, end in zip(starts, clock.ends, strict=True)][1:]
    sampling_s = [at - start for start, at in zip(starts, clock.scored, strict=True)][1:]
    update_s = [end - at for at, end in zip(clock.scored, clock.ends, strict=True)][1:]
    tenth = max(1, steps // 10)
    reached = next((i for i, r in enumerate(clock.rewards) if r >= TARGET_REWARD), None)
    return {
        "steps": steps, "completions_per_step": batch,
        "step_median_s": round(statistics.median(step_s), 4) if step_s else None,
        "sampling_median_s": round(statistics.median(sampling_s), 4) if step_s else None,
        "update_median_s": round(statistics.median(update_s), 4) if step_s else None,
        "first_reward": round(clock.rewards[0], 3), "last_reward": round(clock.rewards[-1], 3),
        "first_tenth_reward": round(statistics.mean(clock.rewards[:tenth]), 3),
        "last_tenth_reward": round(statistics.mean(clock.rewards[-tenth:]), 3),
        "step_reaching_0.9": None if reached is None else reached + 1,
        "seconds_to_0.9": None if reached is None else round(clock.ends[reached] - clock.began, 2),
        "completions_per_s": round(steps * batch / training_s, 1),
        "training_wall_s": round(training_s, 2), "total_wall_s": round(total_s, 2),
        "rewards": [round(r, 3) for r in clock.rewards],
    }  # fmt: skip


async def main(args: argparse.Namespace) -> dict[str, Any]:
    return train(args)  # one process, no stack: nothing to await


def report(result: dict[str, Any]) -> None:
    shown = {k: v for k, v in result.items() if k != "rewards"}
    console.print(key_value_table("TRL GRPOTrainer, the demo's task (medians: step 1 out)", shown))
    console.print("mean reward per step: " + " ".join(f"{r:.2f}" for r in result["rewards"]))


if __name__ == "__main__":
    parser = benchmark_parser(__doc__)
    demo = RunConfig()
    parser.add_argument("--steps", type=int, default=demo.steps)
    parser.add_argument("--groups-per-step", type=int, default=demo.groups_per_step)
    parser.add_argument("--group-size", type=int, default=demo.group_size)
    parser.add_argument("--learning-rate", type=float, default=demo.learning_rate)
    parser.add_argument("--seed", type=int, default=demo.seed)
    run_benchmark(parser, main, report)
