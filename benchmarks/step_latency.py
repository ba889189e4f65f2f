"""Where a training step's wall time goes: the demo's loop, phase by phase.

    .venv/bin/python -m benchmarks.step_latency --steps 12

Runs the demo (its trainer, policy server, projector and runners as processes, on-policy:
the tasks of step n are queued once version n-1 is out) on fresh topics of the embedded
stack, then reads back what the topics and the checkpoints recorded. Per cycle n, from
version n-1 on the resources topic to version n:

  enqueue       version n-1 -> the first task of the step queued (the driver)
  pickup        first task queued -> first attempt started (a runner's fetch)
  sampling      first attempt started -> last rollout ended (the agents, the gateway, the
                policy server, the lanes)
  to trainer    last rollout ended -> the trainer's groups full (the lane's commit, the
                trainer's fetch, trajectory assembly)
  update        build the step's samples, GRPO update (trainer.json's timings)
  publish       update done -> version n on the topic (checkpoint write, hash, publish)

Record timestamps are the producers' (CreateTime); the first cycle (the trainer's start) is
left out. Figures: the median and the slowest of each phase, and its share of the median step;
the mean reward of the first and last tenth of the steps, and the seconds from the trainer's
first version to the first step with a mean reward of 0.9. With --max-staleness 1 (overlap)
the tasks of step n are queued with version n-2, so "enqueue" is negative and the phases
overlap; the step and the time to 0.9 are what compare.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition
from rich.console import Console
from rich.table import Table

from agl_stream.bus.codec import Codec, DecodeError
from agl_stream.bus.kafka import end_offsets
from agl_stream.bus.streams import Topics, read_records
from agl_stream.db.migrate import migrate
from agl_stream.demo.task import tasks
from agl_stream.events import AttemptStarted, ResourcesPublished, RolloutFinished, RolloutQueued
from agl_stream.launch.run import RunConfig, StepPoint, run_training
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings, load
from agl_stream.training.checkpoints import CheckpointStore
from benchmarks.stack import benchmark_parser, fresh_topics, run_benchmark

console = Console()
PHASES = ("enqueue", "pickup", "sampling", "to trainer", "update", "publish")


async def timestamped(kafka: KafkaSettings, names: list[str]) -> list[tuple[float, Any]]:
    """(record timestamp in seconds, event) of every decodable record of the topics."""
    topics = Topics(kafka)
    tps = [
        TopicPartition(topics.name(n), p) for n in names for p in range(topics.specs[n].partitions)
    ]
    ends = await end_offsets(kafka, tps)
    codec = Codec()
    out = []
    async for record in read_records(kafka, dict.fromkeys(tps, 0), ends):
        try:
            out.append((record.timestamp / 1000, codec.decode(record.value)))
        except DecodeError:
            continue
    return out


def version_times(records: list[tuple[float, Any]], run_name: str) -> dict[int, float]:
    """When each step's version of the run reached the resources topic."""
    out: dict[int, float] = {}
    for at, event in records:
        if isinstance(event, ResourcesPublished) and event.resources_id.startswith(f"{run_name}-v"):
            out.setdefault(int(event.metadata.get("step", "-1")), at)
    return out


def cycles(
    records: list[tuple[float, Any]], states: list[dict[str, Any]], run_name: str
) -> list[dict[str, float]]:
    """Each cycle's phases in seconds (pure: from what the topics and checkpoints hold)."""
    versions = version_times(records, run_name)
    step_of: dict[str, int] = {}
    queued: dict[int, list[float]] = defaultdict(list)
    started: dict[int, list[float]] = defaultdict(list)
    ended: dict[int, list[float]] = defaultdict(list)
    for at, event in records:
        if isinstance(event, RolloutQueued) and event.attempt_number == 1:
            group = event.metadata.get("group", "")
            step = int(group.rsplit("-s", 1)[1].split("-g")[0])
            step_of[event.rollout_id] = step
            queued[step].append(at)
    for at, event in records:
        step = step_of.get(getattr(event, "rollout_id", ""), -1)
        if isinstance(event, AttemptStarted):
            started[step].append(at)
        elif isinstance(event, RolloutFinished):
            ended[step].append(at)
    timings = {s["step"]: s.get("timings") for s in states}
    out = []
    for n in sorted(versions):
        before, tasks, t = n - 1, n - 1, timings.get(n)
        if n < 2 or before not in versions or not t or not queued[tasks] or not ended[tasks]:
            continue  # the first cycle includes the trainer's start
        updated = t["ready_at"] + t["build_s"] + t["update_s"]
        out.append({
            "enqueue": min(queued[tasks]) - versions[before],
            "pickup": min(started[tasks]) - min(queued[tasks]),
            "sampling": max(ended[tasks]) - min(started[tasks]),
            "to trainer": t["ready_at"] - max(ended[tasks]),
            "update": t["build_s"] + t["update_s"],
            "publish": versions[n] - updated,
            "step": versions[n] - versions[before],
        })  # fmt: skip
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    run = f"s{uuid.uuid4().hex[:6]}"
    state, kafka = await fresh_topics(f"bench-{run}")
    database = load(DatabaseSettings, database_url=state.database_url).with_database(f"bench_{run}")
    await migrate(database)
    out_dir = Path(tempfile.mkdtemp(prefix="agl-bench-step-"))
    config = RunConfig(
        steps=args.steps, runners=args.runners, concurrency=args.concurrency, out_dir=out_dir,
        run_name=run, seed=args.seed, max_staleness=args.max_staleness, engine=args.engine,
        task_source=tasks,
    )  # fmt: skip
    points: list[tuple[float, StepPoint]] = []  # (wall clock, point)
    began = time.time()
    await asyncio.to_thread(
        run_training, config, kafka, database, lambda p: points.append((time.time(), p))
    )
    wall = time.time() - began
    records = await timestamped(kafka, ["resources", "tasks", "rollouts"])
    states = CheckpointStore(str(config.checkpoint_dir)).lineage()
    measured = cycles(records, states, run)
    step = statistics.median(c["step"] for c in measured)
    rewards = [p.mean_reward for _, p in points]
    tenth = max(1, len(rewards) // 10)
    reached = next((at for at, p in points if p.mean_reward >= 0.9), None)
    first_version = version_times(records, run).get(0, began)
    figures: dict[str, Any] = {
        "engine": args.engine,
        "steps": args.steps, "runners": args.runners, "concurrency": args.concurrency,
        "max_staleness": args.max_staleness, "cycles_measured": len(measured),
        "step_median_s": round(step, 3), "wall_s": round(wall, 1),
        # From the trainer's first version (its start and the stack's are left out).
        "seconds_to_reward_0.9": round(reached - first_version, 1) if reached else None,
        "first_tenth_reward": round(statistics.mean(rewards[:tenth]), 3),
        "last_tenth_reward": round(statistics.mean(rewards[-tenth:]), 3),
    }  # fmt: skip
    for phase in PHASES:
        values = [c[phase] for c in measured]
        figures[f"{phase}_median_s"] = round(statistics.median(values), 3)
        figures[f"{phase}_max_s"] = round(max(values), 3)
    return figures


def report(figures: dict[str, Any]) -> None:
    step = figures["step_median_s"]
    table = Table(
        title=f"one step of the demo ({figures['cycles_measured']} cycles; "
        f"{figures['runners']} runners x concurrency {figures['concurrency']}; "
        f"{figures.get('engine', 'torch')} engine)",
        title_justify="left",
    )
    for column in ("phase", "median s", "max s", "share of the median step"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for phase in PHASES:
        median = figures[f"{phase}_median_s"]
        table.add_row(phase, f"{median:.3f}", f"{figures[f'{phase}_max_s']:.3f}",
                      f"{median / step:.0%}")  # fmt: skip
    table.add_row("step", f"{step:.3f}", "", "")
    console.print(table)
    console.print(
        f"mean reward {figures['first_tenth_reward']:.3f} (first tenth of the steps) -> "
        f"{figures['last_tenth_reward']:.3f} (last tenth); 0.9 reached "
        + (f"{figures['seconds_to_reward_0.9']} s after the first version"
           if figures["seconds_to_reward_0.9"] is not None else "never")
        + f"; {figures['wall_s']} s in all",
        highlight=False,
    )  # fmt: skip


if __name__ == "__main__":
    parser = benchmark_parser(__doc__)
    defaults = RunConfig()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--runners", type=int, default=defaults.runners)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-staleness", type=int, choices=(0, 1), default=0)
    parser.add_argument("--engine", choices=("torch", "vllm"), default=defaults.engine)
    run_benchmark(parser, main, report)
