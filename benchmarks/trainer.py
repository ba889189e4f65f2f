"""Trainer throughput: GRPO on the tiny model on the CPU, online and offline.

    .venv/bin/python -m benchmarks.trainer --groups 64 --group-size 8 --groups-per-step 4

Online: a trainer and a runner (the demo's agent, sampling the latest checkpoint in process)
in this process; --groups tasks of --group-size identical inputs are queued once the first
version is out; the clock runs from the first to the last step. Offline: `retrain` of the
same offset range into a fresh checkpoint directory (nothing published): the trainer alone,
records read back from the broker. Samples are LLM calls trained on (one per attempt here).

Variants, side by side in the same run: the same offline retrain with micro-batches of at
most --micro-batch-tokens padded tokens (gradients accumulated), with gradient checkpointing,
with a LoRA adapter of rank --lora-rank instead of the whole model, and with LoRA and
micro-batches. For each: samples/s of the whole retrain (reading the topics included) and of
the update steps alone (the checkpoints' update timings).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition
from rich.console import Console

from agl_stream.agent.api import load_agent
from agl_stream.bus.streams import read_partitions
from agl_stream.commands.enqueue import RolloutOptions, enqueue
from agl_stream.events import ResourcesPublished
from agl_stream.runner.worker import Runner, RunnerConfig
from agl_stream.runtime.config import KafkaSettings
from agl_stream.training.checkpoints import CheckpointStore
from agl_stream.training.grpo import GRPOConfig
from agl_stream.training.lora import LoraSettings
from agl_stream.training.retrain import resolve_range
from agl_stream.training.trainer import StepReport, Trainer, TrainerConfig
from benchmarks.stack import benchmark_parser, fresh_topics, key_value_table, run_benchmark

console = Console()


async def version_zero(kafka: KafkaSettings, resources_id: str) -> None:
    """Until the trainer has published its first version (what runners sample)."""
    tp = TopicPartition(kafka.topic("resources"), 0)
    for _ in range(600):
        events = await read_partitions(kafka, [tp])
        if any(
            isinstance(e, ResourcesPublished) and e.resources_id == resources_id for e in events
        ):
            return
        await asyncio.sleep(0.5)
    raise TimeoutError(f"the trainer did not publish {resources_id} in 5 minutes")


async def main(args: argparse.Namespace) -> dict[str, Any]:
    run = f"t{uuid.uuid4().hex[:6]}"
    _, kafka = await fresh_topics(f"bench-{run}")
    root = Path(tempfile.mkdtemp(prefix="agl-bench-trainer-"))
    steps: list[tuple[float, StepReport]] = []
    config = TrainerConfig(
        checkpoint_dir=str(root / "online"), run_name=run, group_size=args.group_size,
        groups_per_step=args.groups_per_step, max_steps=args.groups // args.groups_per_step,
        heartbeat_seconds=5.0,
    )  # fmt: skip
    trainer = Trainer(kafka, config, on_step=lambda r: steps.append((time.monotonic(), r)))
    training = asyncio.create_task(trainer.run(asyncio.Event()))
    runner = Runner(
        kafka,
        RunnerConfig(
            agent=load_agent("agl_stream.demo.task:echo_letter_in_process"),
            concurrency=args.concurrency, heartbeat_seconds=5.0,
        ),
    )  # fmt: skip
    stop_runner = asyncio.Event()
    running = asyncio.create_task(runner.run(stop_runner))
    with console.status("online: runner and trainer..."):
        await version_zero(kafka, f"{run}-v0")
        began = time.monotonic()
        for g in range(args.groups):
            await enqueue(
                kafka, [{"letter": "abcde"[g % 5]}] * args.group_size,
                RolloutOptions(metadata={"group": f"{run}-{g}"}),
            )  # fmt: skip
        await asyncio.wait_for(training, args.timeout)
    stop_runner.set()
    await asyncio.wait_for(running, 60)
    trained = steps
    online_seconds = trained[-1][0] - began
    online_samples = sum(r.counts.get("samples", 0) for _, r in trained)

    start, until = await resolve_range(kafka, {}, {})
    grpo = GRPOConfig()
    micro = GRPOConfig(micro_batch_tokens=args.micro_batch_tokens)
    lora = LoraSettings(rank=args.lora_rank)
    variants: dict[str, tuple[GRPOConfig, LoraSettings | None]] = {"offline": (grpo, None)}
    if args.variants:
        variants.update({
            "micro_batched": (micro, None),
            "checkpointing": (GRPOConfig(gradient_checkpointing=True), None),
            "lora": (grpo, lora),
            "lora_micro_batched": (micro, lora),
        })  # fmt: skip
    figures: dict[str, Any] = {
        "groups": args.groups, "group_size": args.group_size,
        "groups_per_step": args.groups_per_step, "steps": len(trained),
        "online_samples": online_samples, "online_seconds": round(online_seconds, 1),
        "online_samples_per_s": round(online_samples / online_seconds, 1),
    }  # fmt: skip
    for name, (grpo_config, lora_settings) in variants.items():
        offline = TrainerConfig(
            checkpoint_dir=str(root / name), run_name=f"{run}-{name}",
            group_size=args.group_size, groups_per_step=args.groups_per_step, publish=False,
            start=start, until=until, grpo=grpo_config, lora=lora_settings,
        )  # fmt: skip
        offline_steps: list[StepReport] = []
        began = time.monotonic()
        with console.status(f"offline ({name}): retrain of the same range..."):
            await asyncio.wait_for(
                Trainer(kafka, offline, on_step=offline_steps.append).run(asyncio.Event()),
                args.timeout,
            )
        seconds = time.monotonic() - began
        samples = sum(r.counts.get("samples", 0) for r in offline_steps)
        updating = sum(
            s["timings"]["update_s"] for s in CheckpointStore(offline.checkpoint_dir).lineage()
            if "timings" in s
        )  # fmt: skip
        figures[f"{name}_samples"] = samples
        figures[f"{name}_seconds"] = round(seconds, 1)
        figures[f"{name}_samples_per_s"] = round(samples / seconds, 1)
        figures[f"{name}_update_samples_per_s"] = round(samples / updating, 1)
    update_seconds = [r.seconds for _, r in trained]
    figures["step_seconds_mean"] = round(sum(update_seconds) / len(update_seconds), 2)
    figures["peak_rss_mb_of_this_process"] = round(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1
    )
    return figures


def report(result: dict[str, Any]) -> None:
    console.print(key_value_table("trainer benchmark", result))


if __name__ == "__main__":
    parser = benchmark_parser(__doc__)
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--micro-batch-tokens", type=int, default=64)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument(
        "--no-variants", dest="variants", action="store_false",
        help="only the whole-model offline retrain",
    )  # fmt: skip
    run_benchmark(parser, main, report)
