"""Runner throughput: N runner processes against the embedded stack, synthetic agent.

    .venv/bin/python -m benchmarks.runners --runners 4 --rollouts 10000 --max-rounds 5

Measures from the first enqueue to the last terminal event on the broker (with every span
there): rollouts/s, spans/s, enqueue-to-start latency p50/p99, and per process the CPU
seconds and peak RSS, plus each runner's RSS after 1,000 rollouts and at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from aiokafka import TopicPartition
from rich.console import Console
from rich.table import Table

from agl_stream.bus.codec import Codec, DecodeError
from agl_stream.bus.kafka import consumer, end_offsets
from agl_stream.bus.streams import read_records
from agl_stream.bus.topic_spec import load_topic_specs
from agl_stream.commands.enqueue import RolloutOptions, enqueue
from agl_stream.embedded.stack import StackState
from agl_stream.events import AttemptFinished, AttemptStarted, RolloutFinished, RolloutQueued
from agl_stream.runtime.config import KafkaSettings, child_environment
from benchmarks.stack import benchmark_parser, fresh_topics, run_benchmark

console = Console()
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class ProcessSample:
    cpu_seconds: float
    rss_mb: float
    peak_rss_mb: float


def _cpu_seconds(stat: str) -> float:
    """User + system CPU seconds from the text of /proc/PID/stat."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def sample(pid: int) -> ProcessSample:
    cpu = _cpu_seconds(Path(f"/proc/{pid}/stat").read_text())
    status = dict(
        line.split(":", 1)
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if ":" in line
    )

    def mb(key: str) -> float:
        return int(status[key].split()[0]) / 1024

    return ProcessSample(cpu, mb("VmRSS"), mb("VmHWM"))


def stack_cpu(state: StackState) -> dict[str, float]:
    """CPU seconds so far of the embedded stack's processes: the Kafka nodes, and every
    PostgreSQL process (backends included, the benchmark's own connections too)."""
    totals = {"broker": 0.0, "postgres": 0.0}
    brokers = {str(pid) for pid in state.broker_pids}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        command = stat[stat.index("(") + 1 : stat.rindex(")")]
        if entry.name in brokers:
            totals["broker"] += _cpu_seconds(stat)
        elif command == "postgres":
            totals["postgres"] += _cpu_seconds(stat)
    return totals


async def positions(kafka: KafkaSettings, topic: str) -> dict[TopicPartition, int]:
    spec = load_topic_specs()[topic]
    return await end_offsets(
        kafka, [TopicPartition(kafka.topic(topic), p) for p in range(spec.partitions)]
    )


async def count_records(kafka: KafkaSettings, start: dict[TopicPartition, int]) -> int:
    """Committed records from `start` to the end now (offsets also count transaction
    markers, so they are read, not subtracted)."""
    ends = await end_offsets(kafka, start)
    return sum([1 async for _ in read_records(kafka, start, ends)])


class Monitor:
    """Follows the rollouts topic from given offsets: terminal events, starts, span counts."""

    def __init__(self) -> None:
        self.finished: dict[str, int] = {}  # rollout id -> terminal record timestamp (ms)
        self.started: dict[str, float] = {}  # rollout id -> AttemptStarted time (s)
        self.span_count = 0
        self.rss_at_1000: dict[int, float] = {}

    async def follow(
        self,
        kafka: KafkaSettings,
        start: dict[TopicPartition, int],
        want: int,
        runner_pids: list[int],
    ) -> None:
        codec = Codec()
        async with consumer(kafka) as c:
            c.assign(list(start))
            for tp, offset in start.items():
                c.seek(tp, offset)
            while len(self.finished) < want:
                batch = await c.getmany(timeout_ms=200)
                for records in batch.values():
                    for record in records:
                        try:
                            event = codec.decode(record.value)
                        except DecodeError:
                            continue
                        if isinstance(event, RolloutFinished):
                            self.finished[event.rollout_id] = record.timestamp
                        elif isinstance(event, AttemptStarted):
                            self.started.setdefault(event.rollout_id, event.occurred_at.timestamp())
                        elif isinstance(event, AttemptFinished):
                            self.span_count += event.span_count
                if len(self.finished) >= 1000 and not self.rss_at_1000:
                    self.rss_at_1000 = {pid: sample(pid).rss_mb for pid in runner_pids}


async def queued_times(kafka: KafkaSettings, start: dict[TopicPartition, int]) -> dict[str, float]:
    ends = await positions(kafka, "tasks")
    codec = Codec()
    out: dict[str, float] = {}
    async for record in read_records(kafka, start, ends):
        event = codec.decode(record.value)
        if isinstance(event, RolloutQueued) and event.attempt_number == 1:
            out[event.rollout_id] = event.occurred_at.timestamp()
    return out


async def run_batch(
    kafka: KafkaSettings, count: int, args: argparse.Namespace, runner_pids: list[int]
) -> tuple[Monitor, float, dict[TopicPartition, int]]:
    start_rollouts = await positions(kafka, "rollouts")
    start_tasks = await positions(kafka, "tasks")
    monitor = Monitor()
    follow = asyncio.create_task(monitor.follow(kafka, start_rollouts, count, runner_pids))
    tasks = [{"seed": i, "max_rounds": args.max_rounds, "sleep": args.sleep} for i in range(count)]
    first_enqueue = time.time()
    await enqueue(kafka, tasks, RolloutOptions())
    await follow
    return monitor, first_enqueue, start_tasks


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main(args: argparse.Namespace) -> dict[str, object]:
    state, kafka = await fresh_topics(f"bench-{uuid.uuid4().hex[:6]}")
    env = child_environment(kafka)
    runners = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agl_stream.cli.main", "worker", "runner",
            "--agent", "benchmarks.synthetic:agent", "--concurrency", str(args.concurrency),
            "--linger-ms", str(args.linger_ms),
            "--worker-id", f"bench-{i}", env=env, stdout=asyncio.subprocess.DEVNULL,
        )
        for i in range(args.runners)
    ]  # fmt: skip
    pids = [r.pid for r in runners]
    try:
        with console.status("warming up (runners join the group)..."):
            await run_batch(kafka, 25 * args.runners, args, pids)
        before = {pid: sample(pid) for pid in [*pids, *state.broker_pids] if pid}
        span_start = await positions(kafka, "spans")
        with console.status(f"running {args.rollouts} rollouts..."):
            monitor, first_enqueue, start_tasks = await run_batch(kafka, args.rollouts, args, pids)
        last_terminal = max(monitor.finished.values()) / 1000
        spans_on_broker = await count_records(kafka, span_start)
        after = {pid: sample(pid) for pid in before}
        queued = await queued_times(kafka, start_tasks)
    finally:
        for r in runners:
            r.send_signal(signal.SIGTERM)
        await asyncio.gather(*(r.wait() for r in runners))
    elapsed = last_terminal - first_enqueue
    latencies = [monitor.started[r] - queued[r] for r in monitor.started if r in queued]
    names = {pid: f"broker (kafka node {i + 1})" for i, pid in enumerate(state.broker_pids)}
    processes = {
        (names[pid] if pid in names else f"runner {pids.index(pid)}"): {
            "cpu_seconds": round(after[pid].cpu_seconds - before[pid].cpu_seconds, 2),
            "peak_rss_mb": round(after[pid].peak_rss_mb, 1),
        }
        for pid in before
    }
    result: dict[str, object] = {
        "runners": args.runners, "concurrency": args.concurrency, "linger_ms": args.linger_ms,
        "rollouts": args.rollouts,
        "max_rounds": args.max_rounds, "sleep": args.sleep,
        "seconds": round(elapsed, 2),
        "rollouts_per_s": round(args.rollouts / elapsed, 1),
        "spans_per_s": round(monitor.span_count / elapsed, 1),
        "spans": monitor.span_count, "spans_on_broker": spans_on_broker,
        "enqueue_to_start_p50_ms": round(statistics.median(latencies) * 1000, 1),
        "enqueue_to_start_p99_ms": round(percentile(latencies, 0.99) * 1000, 1),
        "processes": processes,
        "runner_rss_mb_after_1000": [round(monitor.rss_at_1000.get(p, 0), 1) for p in pids],
        "runner_rss_mb_at_end": [round(after[p].rss_mb, 1) for p in pids],
    }  # fmt: skip
    return result


def report(result: dict[str, object]) -> None:
    table = Table(title="runner benchmark", title_justify="left", show_header=False)
    for key in (
        "runners",
        "concurrency",
        "linger_ms",
        "rollouts",
        "max_rounds",
        "sleep",
        "seconds",
        "rollouts_per_s",
        "spans_per_s",
        "spans",
        "spans_on_broker",
        "enqueue_to_start_p50_ms",
        "enqueue_to_start_p99_ms",
        "runner_rss_mb_after_1000",
        "runner_rss_mb_at_end",
    ):
        table.add_row(key, str(result[key]))
    console.print(table)
    procs = Table(title="processes (measured run)", title_justify="left")
    for column in ("process", "CPU s", "peak RSS MB"):
        procs.add_column(column)
    for name, values in result["processes"].items():  # type: ignore[attr-defined]
        procs.add_row(name, str(values["cpu_seconds"]), str(values["peak_rss_mb"]))
    console.print(procs)


if __name__ == "__main__":
    parser = benchmark_parser(__doc__)
    parser.add_argument("--runners", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=32, help="rollouts at once per runner")
    parser.add_argument("--linger-ms", type=int, default=10, help="runners' --linger-ms")
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--max-rounds", type=int, default=5)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds of sleep per span")
    run_benchmark(parser, main, report)
