"""What Agent Lightning's store API costs on agl-stream: each call of one rollout's life
(enqueue, dequeue, a sequence id, an OTel span, the attempt's end, a query) timed on
AglStreamStore (a Kafka transaction and the projection's wait, so the next call reads it)
and, side by side in the same run, on Agent Lightning's own InMemoryLightningStore, which
keeps everything in the process. Also how long a store takes to start (fencing, the
projector joining its group) and to hand out its first rollout.

    .venv/bin/python -m benchmarks.agl_store --rollouts 200 --runners 4
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from agl_stream.db.migrate import migrate
from agl_stream.runtime.config import DatabaseSettings, load
from benchmarks.stack import benchmark_parser, fresh_topics, key_value_table, run_benchmark

CALLS = ("enqueue_rollout", "dequeue_rollout", "get_next_span_sequence_id", "add_otel_span",
         "update_attempt", "query_rollouts")  # fmt: skip


async def _life(store: Any, timings: dict[str, list[float]], span: Any, worker: str) -> None:
    async def timed(name: str, call: Callable[[], Awaitable[Any]]) -> Any:
        began = time.perf_counter()
        result = await call()
        timings[name].append((time.perf_counter() - began) * 1000)
        return result

    await timed("enqueue_rollout", lambda: store.enqueue_rollout(input={"q": 1}))
    claimed = await timed("dequeue_rollout", lambda: store.dequeue_rollout(worker_id=worker))
    assert claimed is not None  # each runner enqueues before it dequeues
    rid, aid = claimed.rollout_id, claimed.attempt.attempt_id
    await timed("get_next_span_sequence_id", lambda: store.get_next_span_sequence_id(rid, aid))
    await timed("add_otel_span", lambda: store.add_otel_span(rid, aid, span()))
    await timed("update_attempt", lambda: store.update_attempt(rid, aid, status="succeeded"))
    await timed("query_rollouts", lambda: store.query_rollouts(rollout_id_in=[rid]))


async def _measure(store: Any, rollouts: int, runners: int, span: Any) -> dict[str, list[float]]:
    """`rollouts` lives, run by `runners` concurrent runners (each its own worker id)."""
    timings: dict[str, list[float]] = {name: [] for name in CALLS}

    async def runner(index: int) -> None:
        for _ in range(rollouts // runners + (index < rollouts % runners)):
            await _life(store, timings, span, f"bench-{index}")

    await asyncio.gather(*(runner(i) for i in range(runners)))
    return timings


def _quantiles(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from agentlightning.store.memory import InMemoryLightningStore
    from opentelemetry.sdk.trace import TracerProvider

    from agl_stream.compat.agl import AglStreamStore

    tracer = TracerProvider().get_tracer("bench")

    def span() -> Any:
        s = tracer.start_span("step", attributes={"k": 1})
        s.end()
        return s

    run = uuid.uuid4().hex[:8]
    state, kafka = await fresh_topics(f"bench-agl-{run}")
    database = load(DatabaseSettings, database_url=state.database_url).with_database(f"bench_{run}")
    await migrate(database)
    store = AglStreamStore(kafka, database)
    began = time.perf_counter()
    await store.statistics()
    started = time.perf_counter() - began
    first = time.perf_counter()
    await store.enqueue_rollout(input="first")
    await store.dequeue_rollout()
    first_claim = time.perf_counter() - first
    began = time.perf_counter()
    ours = await _measure(store, args.rollouts, args.runners, span)
    ours_seconds = time.perf_counter() - began
    await store.aclose()
    memory = InMemoryLightningStore()
    began = time.perf_counter()
    theirs = await _measure(memory, args.rollouts, args.runners, span)
    theirs_seconds = time.perf_counter() - began
    figures: dict[str, Any] = {
        "rollouts": args.rollouts,
        "concurrent runners": args.runners,
        "store start s": round(started, 2),
        "first enqueue + dequeue s": round(first_claim, 2),
        "rollout lives/s, AglStreamStore": round(args.rollouts / ours_seconds, 1),
        "rollout lives/s, InMemoryLightningStore": round(args.rollouts / theirs_seconds, 1),
    }
    for name in CALLS:
        p50, p99 = _quantiles(ours[name])
        m50, m99 = _quantiles(theirs[name])
        figures[f"{name} ms p50/p99"] = [round(p50, 1), round(p99, 1), round(m50, 2), round(m99, 2)]
    return figures


def report(figures: dict[str, Any]) -> None:
    console = Console()
    console.print(key_value_table("Agent Lightning's store API on agl-stream", {
        k: v for k, v in figures.items() if "ms p50" not in k
    }))  # fmt: skip
    table = Table(title="one call (ms)", title_justify="left")
    for column in ("call", "AglStreamStore p50", "p99", "InMemoryLightningStore p50", "p99"):
        table.add_column(column, justify="left" if column == "call" else "right")
    for name in CALLS:
        table.add_row(name, *(str(v) for v in figures[f"{name} ms p50/p99"]))
    console.print(table)


if __name__ == "__main__":
    parser = benchmark_parser(__doc__)
    parser.add_argument("--rollouts", type=int, default=200, help="rollout lives to time")
    parser.add_argument("--runners", type=int, default=4, help="concurrent runners")
    run_benchmark(parser, main, report)
