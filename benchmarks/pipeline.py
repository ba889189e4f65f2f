"""End-to-end latency and memory over a long run: runner processes and a projector process
against the embedded stack, tasks enqueued at a steady rate for --seconds.

    .venv/bin/python -m benchmarks.pipeline --runners 2 --rate 20 --seconds 300

Per rollout: from the moment its task was sent to when it started (AttemptStarted), finished
(RolloutFinished) and could be read back terminal through the read model (polled every 20
ms); p50/p99/max of each. Every --sample-every seconds, the RSS of each process (runners,
projector, broker; PostgreSQL is left out: it runs as several processes whose
shared memory RSS counts twice): what grows over a long run shows here.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from typing import Any

import asyncpg
from rich.console import Console
from rich.table import Table

from agl_stream.bus.kafka import producer
from agl_stream.bus.streams import EventPublisher, Topics
from agl_stream.commands.enqueue import RolloutOptions, make_rollout
from agl_stream.db.migrate import migrate
from agl_stream.runtime.config import DatabaseSettings, child_environment, load
from benchmarks.runners import percentile, sample
from benchmarks.stack import benchmark_parser, fresh_topics, run_benchmark

console = Console()
TERMINAL = ("succeeded", "failed", "cancelled")


async def worker(env: dict[str, str], *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agl_stream.cli.main", "worker", *args,
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip


async def watch(
    dsn: str, sent: dict[str, float], seen: dict[str, tuple[float, float, float]],
    done: asyncio.Event,
) -> None:  # fmt: skip
    """Poll the read model for rollouts sent and not yet seen terminal; note when each shows,
    with its started and finished times."""
    conn = await asyncpg.connect(dsn)
    try:
        while not (done.is_set() and len(seen) >= len(sent)):
            pending = [r for r in sent if r not in seen]
            if pending:
                rows = await conn.fetch(
                    "SELECT rollout_id, started_at, finished_at FROM read_model_1.rollouts "
                    "WHERE rollout_id = ANY($1) AND status = ANY($2)",
                    pending, list(TERMINAL),
                )  # fmt: skip
                now = time.time()
                for r in rows:
                    seen[r["rollout_id"]] = (
                        r["started_at"].timestamp(), r["finished_at"].timestamp(), now
                    )  # fmt: skip
            await asyncio.sleep(0.02)
    finally:
        await conn.close()


def spread(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {
        "p50_ms": round(statistics.median(ms), 1),
        "p99_ms": round(percentile(ms, 0.99), 1),
        "max_ms": round(max(ms), 1),
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    run = f"p{uuid.uuid4().hex[:6]}"
    state, kafka = await fresh_topics(f"bench-{run}")
    database = load(DatabaseSettings, database_url=state.database_url).with_database(f"bench_{run}")
    await migrate(database)
    env = child_environment(kafka, database)
    common = ["--heartbeat", "2"]
    projector = await worker(env, "--role", "projector", "--worker-id", "bench-projector", *common)
    runners = [
        await worker(
            env, "--role", "runner", "--agent", "benchmarks.synthetic:agent", "--concurrency",
            "32", "--worker-id", f"bench-runner-{i}", *common,
        )
        for i in range(args.runners)
    ]  # fmt: skip
    named = {f"runner-{i}": r.pid for i, r in enumerate(runners)}
    named["projector"] = projector.pid
    named["broker"] = state.broker_pid or 0
    sent: dict[str, float] = {}
    seen: dict[str, tuple[float, float, float]] = {}
    done = asyncio.Event()
    memory: list[dict[str, float]] = []
    try:
        await asyncio.sleep(8)  # the runners join their group, the projector its own
        watcher = asyncio.create_task(watch(database.asyncpg_dsn, sent, seen, done))
        began = time.monotonic()
        tick, next_sample = 0.1, began
        async with producer(kafka, linger_ms=0) as prod:
            publisher = EventPublisher(prod, Topics(kafka))
            with console.status("steady load...") as status:
                while time.monotonic() - began < args.seconds:
                    owed = args.rate * (time.monotonic() - began) - len(sent)
                    batch = [{"seed": len(sent) + i} for i in range(int(owed))]
                    if batch:
                        at = time.time()
                        events = [make_rollout(task, RolloutOptions()) for task in batch]
                        await asyncio.gather(*[await publisher.send("tasks", e) for e in events])
                        sent.update((e.rollout_id, at) for e in events)
                    if time.monotonic() >= next_sample:
                        memory.append(
                            {"t": round(time.monotonic() - began), "rollouts": len(seen)}
                            | {n: round(sample(p).rss_mb, 1) for n, p in named.items() if p}
                        )
                        next_sample += args.sample_every
                        status.update(f"steady load: {len(sent)} sent, {len(seen)} finished")
                    await asyncio.sleep(tick)
        done.set()
        await asyncio.wait_for(watcher, 120)
        memory.append(
            {"t": round(time.monotonic() - began), "rollouts": len(seen)}
            | {n: round(sample(p).rss_mb, 1) for n, p in named.items() if p}
        )
    finally:
        for process in [*runners, projector]:
            if process.returncode is None:
                process.terminate()
        await asyncio.gather(*(p.wait() for p in [*runners, projector]))
        admin = await asyncpg.connect(database.with_database("postgres").asyncpg_dsn)
        try:
            await admin.execute(f'DROP DATABASE "bench_{run}" WITH (FORCE)')
        finally:
            await admin.close()
    started = [seen[r][0] - at for r, at in sent.items()]
    finished = [seen[r][1] - at for r, at in sent.items()]
    visible = [seen[r][2] - at for r, at in sent.items()]
    first, last = memory[1] if len(memory) > 1 else memory[0], memory[-1]
    growth = {
        n: round((last[n] - first[n]) / max(last["rollouts"] - first["rollouts"], 1) * 1000, 2)
        for n in named
        if n in last
    }
    return {
        "runners": args.runners, "rate_per_s": args.rate, "seconds": args.seconds,
        "rollouts": len(sent),
        "enqueue_to_start": spread(started), "enqueue_to_finish": spread(finished),
        "enqueue_to_read_model": spread(visible),
        "rss_mb_samples": memory, "rss_growth_mb_per_1000_rollouts": growth,
    }  # fmt: skip


def report(result: dict[str, Any]) -> None:
    table = Table(title="end-to-end latency", title_justify="left")
    for column in ("from enqueue to", "p50 ms", "p99 ms", "max ms"):
        table.add_column(column, justify="right")
    for key in ("enqueue_to_start", "enqueue_to_finish", "enqueue_to_read_model"):
        r = result[key]
        table.add_row(key.removeprefix("enqueue_to_"), *(str(r[k]) for k in r))
    console.print(table)
    samples = result["rss_mb_samples"]
    memory = Table(title="RSS (MB) over the run", title_justify="left")
    for column in samples[0]:
        memory.add_column(column, justify="right")
    for row in samples:
        memory.add_row(*(str(row.get(c, "")) for c in samples[0]))
    console.print(memory)
    console.print(f"growth, MB per 1,000 rollouts: {result['rss_growth_mb_per_1000_rollouts']}")


if __name__ == "__main__":
    parser = benchmark_parser(__doc__)
    parser.add_argument("--runners", type=int, default=2)
    parser.add_argument("--rate", type=float, default=20, help="rollouts enqueued per second")
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument(
        "--sample-every", type=float, default=30, help="seconds between RSS samples"
    )
    run_benchmark(parser, main, report)
