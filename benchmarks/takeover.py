"""Takeover cost against history: how long a runner takes to settle a tasks partition (fence
the previous writer, read the checkpoint, fold the co-partitioned rollouts partition) when
that rollouts partition holds a long history, against an empty one.

    .venv/bin/python -m benchmarks.takeover --history 1000000

Takeovers of tasks partition 0 by a fresh in-process runner after another one ran 20
rollouts of that partition and stopped: on fresh topics (nothing old), and on topics whose
rollouts partition 0 holds --history old records (finished rollouts of long ago). On the
latter, the group's very first takeover has no checkpoint yet and folds from offset 0, as
every takeover did before checkpoints: that is the cost they avoid.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from typing import Any

from aiokafka.partitioner import DefaultPartitioner
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from agl_stream.agent import rollout
from agl_stream.bus.codec import Codec
from agl_stream.bus.kafka import producer
from agl_stream.bus.streams import Topics
from agl_stream.commands.enqueue import RolloutOptions, enqueue
from agl_stream.events import RolloutFinished, RolloutStatus
from agl_stream.runner.worker import Runner, RunnerConfig
from agl_stream.runtime.config import KafkaSettings
from benchmarks.stack import benchmark_parser, fresh_topics, run_benchmark

console = Console()


@rollout
async def quick(task: dict[str, Any]) -> float:
    return 1.0


def ids_on_partition_0(partitions: int, count: int, prefix: str) -> list[str]:
    chooser, every = DefaultPartitioner(), list(range(partitions))
    found: list[str] = []
    i = 0
    while len(found) < count:
        candidate = f"{prefix}-{i}"
        if chooser(candidate.encode(), every, every) == 0:
            found.append(candidate)
        i += 1
    return found


async def write_history(kafka: KafkaSettings, count: int) -> None:
    """`count` RolloutFinished records of old rollouts on rollouts partition 0."""
    topic, codec = Topics(kafka).name("rollouts"), Codec()
    columns = (TextColumn("history"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        bar = progress.add_task("records", total=count)
        async with producer(kafka, linger_ms=20, max_batch_size=1 << 20) as prod:
            chunk: list[asyncio.Future[Any]] = []
            for i in range(count):
                event = RolloutFinished(
                    rollout_id=f"old-{i}", status=RolloutStatus.SUCCEEDED, attempt_count=1
                )
                chunk.append(await prod.send(topic, codec.encode(event), partition=0))
                if len(chunk) >= 20_000:
                    await asyncio.gather(*chunk)
                    progress.advance(bar, len(chunk))
                    chunk = []
            await asyncio.gather(*chunk)
            progress.advance(bar, len(chunk))


async def takeovers(kafka: KafkaSettings, group: str) -> list[tuple[int, float]]:
    """Twice: a fresh runner of `group` takes tasks partition 0 over, runs 20 rollouts of it
    and stops. The first takes over with no checkpoint (the group never committed), the
    second from the first one's. (rollouts records its fold read, seconds to settle) each."""
    partitions = Topics(kafka).specs["tasks"].partitions
    found = []
    for round_ in range(2):
        ids = ids_on_partition_0(partitions, 20, f"r{round_}-{uuid.uuid4().hex[:6]}")
        await enqueue(kafka, [{"rollout_id": r} for r in ids], RolloutOptions())
        runner = Runner(kafka, RunnerConfig(agent=quick, group_id=group, session_timeout_ms=6000))
        stop = asyncio.Event()
        job = asyncio.create_task(runner.run(stop))
        while runner.counts["rollouts_succeeded"] < len(ids):
            if job.done():
                await job  # raises what stopped it
            await asyncio.sleep(0.1)
        stop.set()
        await job
        taken = next(t for t in runner.takeovers if t.tp.partition == 0)
        found.append((taken.records_read, taken.seconds))
    return found


async def main(args: argparse.Namespace) -> dict[str, object]:
    _, empty = await fresh_topics(f"tk{uuid.uuid4().hex[:6]}")
    _, (read_empty, seconds_empty) = await takeovers(empty, "tk-empty")
    _, full = await fresh_topics(f"tk{uuid.uuid4().hex[:6]}")
    began = time.monotonic()
    await write_history(full, args.history)
    write_seconds = time.monotonic() - began
    (read_zero, seconds_zero), (read_full, seconds_full) = await takeovers(full, "tk-full")
    return {
        "history_records": args.history,
        "history_write_s": round(write_seconds, 1),
        "empty_records_read": read_empty,
        "empty_takeover_s": round(seconds_empty, 3),
        "history_records_read": read_full,
        "history_takeover_s": round(seconds_full, 3),
        "from_zero_records_read": read_zero,
        "from_zero_takeover_s": round(seconds_zero, 3),
        "history_to_empty_ratio": round(seconds_full / seconds_empty, 2),
    }


def report(result: dict[str, object]) -> None:
    table = Table(title="takeover of one tasks partition", title_justify="left")
    for column in ("rollouts partition", "records its fold read", "seconds to settle"):
        table.add_column(column)
    table.add_row("empty", str(result["empty_records_read"]), str(result["empty_takeover_s"]))
    table.add_row(
        f"{result['history_records']:,} old records, checkpoint",
        str(result["history_records_read"]),
        str(result["history_takeover_s"]),
    )
    table.add_row(
        f"{result['history_records']:,} old records, no checkpoint (from 0)",
        str(result["from_zero_records_read"]),
        str(result["from_zero_takeover_s"]),
    )
    console.print(table)
    console.print(f"history / empty: {result['history_to_empty_ratio']}x")


if __name__ == "__main__":
    parser = benchmark_parser(__doc__)
    parser.add_argument("--history", type=int, default=1_000_000, help="old records")
    run_benchmark(parser, main, report)
