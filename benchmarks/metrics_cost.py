"""What watching a runner costs it: /metrics scraped every 15 s and every 1 s, and OTLP export.

    .venv/bin/python -m benchmarks.metrics_cost --rate 20 --seconds 120

Side by side in one run, runner processes each on topics of their own, all with
--metrics-port and the same paced load (--rate rollouts/s of the synthetic agent for
--seconds): two never scraped (their difference is the noise floor), one scraped every 15 s,
one every 1 s, and one exporting its spans and metrics by OTLP (metrics every 15 s) to a
receiver in this process. For each: its CPU seconds from the first rollout queued until every
one has ended, and the difference to the first unscraped runner. (CPU is read from
/proc/PID/stat, in ticks of 10 ms; the two unscraped runners show how far apart identical
runners land, which is more than a scrape costs: hence the direct measure.)

Then one scrape's cost, measured directly: --burst scrapes back to back of the runner scraped
every second, once the load has stopped, its CPU over them less the unscraped runner's over
the same time; and that cost at 15 s and at 1 s as a share of a loaded runner's CPU (the
issue's target: under 1%).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from rich.console import Console
from rich.table import Table

from agl_stream.bus.kafka import producer
from agl_stream.bus.streams import EventPublisher, Topics
from agl_stream.commands.enqueue import RolloutOptions, make_rollout
from agl_stream.embedded.process import free_port
from agl_stream.runtime.config import KafkaSettings, child_environment
from benchmarks.runners import Monitor, positions, sample
from benchmarks.stack import benchmark_parser, fresh_topics, run_benchmark
from tests.support.otlp_receiver import otlp_receiver

console = Console()
MEASURED = ("none", "none (again)", "every 15 s", "every 1 s", "otlp")


@dataclass
class Pipeline:
    """One runner on topics of its own, and how it is watched."""

    name: str
    kafka: KafkaSettings
    port: int
    scrape_every: float | None = None
    env: dict[str, str] = field(default_factory=dict)
    process: asyncio.subprocess.Process | None = None
    scrapes: int = 0
    page_bytes: int = 0

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"


async def scrape(session: aiohttp.ClientSession, pipeline: Pipeline) -> None:
    async with session.get(pipeline.url) as response:
        body = await response.read()
        assert response.status == 200, body[:200]
    pipeline.scrapes += 1
    pipeline.page_bytes = len(body)


async def scraping(session: aiohttp.ClientSession, pipeline: Pipeline) -> None:
    """Scrape every `scrape_every` seconds, on a fixed schedule, as Prometheus does."""
    assert pipeline.scrape_every is not None
    next_at = time.monotonic()
    while True:
        await scrape(session, pipeline)
        next_at += pipeline.scrape_every
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))


async def paced_load(pipeline: Pipeline, rate: int, seconds: int) -> None:
    """`rate` rollouts each second for `seconds` seconds, on one producer."""
    async with producer(pipeline.kafka) as prod:
        publisher = EventPublisher(prod, Topics(pipeline.kafka))
        began = time.monotonic()
        for second in range(seconds):
            tasks = [{"seed": second * rate + i, "max_rounds": 5} for i in range(rate)]
            await publisher.publish_many(
                "tasks", [make_rollout(t, RolloutOptions()) for t in tasks]
            )
            await asyncio.sleep(max(0.0, began + second + 1 - time.monotonic()))


async def until_answers(session: aiohttp.ClientSession, pipeline: Pipeline) -> None:
    for _ in range(600):
        assert pipeline.process is not None
        assert pipeline.process.returncode is None, f"runner {pipeline.name} stopped"
        with contextlib.suppress(aiohttp.ClientConnectionError):
            await scrape(session, pipeline)
            pipeline.scrapes = 0
            return
        await asyncio.sleep(0.1)
    raise SystemExit(f"runner {pipeline.name} never answered on {pipeline.url}")


@contextlib.asynccontextmanager
async def runners(pipelines: list[Pipeline], concurrency: int) -> AsyncIterator[None]:
    for p in pipelines:
        p.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agl_stream.cli.main", "worker", "runner",
            "--agent", "benchmarks.synthetic:agent", "--concurrency", str(concurrency),
            "--metrics-port", str(p.port), "--worker-id", f"metrics-cost-{p.name}",
            env={**child_environment(p.kafka), **p.env}, stdout=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
    try:
        yield
    finally:
        for p in pipelines:
            if p.process is not None and p.process.returncode is None:
                p.process.send_signal(signal.SIGTERM)
        await asyncio.gather(*(p.process.wait() for p in pipelines if p.process is not None))


async def run_load(pipelines: list[Pipeline], rate: int, seconds: int) -> float:
    """The load on every pipeline at once; returns when every rollout has ended."""
    monitors = []
    for p in pipelines:
        start = await positions(p.kafka, "rollouts")
        monitor = Monitor()
        monitors.append(asyncio.create_task(monitor.follow(p.kafka, start, rate * seconds, [])))
    began = time.monotonic()
    await asyncio.gather(*(paced_load(p, rate, seconds) for p in pipelines))
    await asyncio.gather(*monitors)
    return time.monotonic() - began


async def main(args: argparse.Namespace) -> dict[str, Any]:
    run = uuid.uuid4().hex[:6]
    async with otlp_receiver() as receiver:
        pipelines = []
        for i, name in enumerate(MEASURED):
            _, kafka = await fresh_topics(f"bench-mc{i}-{run}")
            every = {"every 15 s": 15.0, "every 1 s": 1.0}.get(name)
            env = {}
            if name == "otlp":
                env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
                       "OTEL_METRIC_EXPORT_INTERVAL": "15000"}  # fmt: skip
            pipelines.append(Pipeline(name, kafka, free_port(), every, env))
        async with aiohttp.ClientSession() as session, runners(pipelines, args.concurrency):
            for p in pipelines:
                await until_answers(session, p)
            with console.status("warming up (each runner joins its group)..."):
                await run_load(pipelines, args.rate, 3)
            before = {p.name: sample(p.pid).cpu_seconds for p in pipelines}
            scrapers = [
                asyncio.create_task(scraping(session, p)) for p in pipelines if p.scrape_every
            ]
            with console.status(f"{args.rate} rollouts/s on each runner for {args.seconds} s..."):
                seconds = await run_load(pipelines, args.rate, args.seconds)
            for task in scrapers:
                task.cancel()
            await asyncio.gather(*scrapers, return_exceptions=True)
            after = {p.name: sample(p.pid).cpu_seconds for p in pipelines}
            scrapes = {p.name: p.scrapes for p in pipelines}
            burst = await scrape_burst(session, pipelines, args.burst)
        spans_received = len(receiver.spans)
    cpu = {name: round(after[name] - before[name], 2) for name in before}
    base = cpu["none"]
    loaded_share = base / seconds  # of one core, while it runs the load
    per_scrape = burst["cpu_ms_per_scrape"] / 1000
    by_name = {p.name: p for p in pipelines}
    return {
        "rate_per_runner": args.rate, "seconds_of_load": args.seconds,
        "rollouts_per_runner": args.rate * args.seconds, "concurrency": args.concurrency,
        "window_seconds": round(seconds, 1),
        "runners": {
            name: {
                "cpu_seconds": cpu[name],
                "vs_none_percent": round(100 * (cpu[name] - base) / base, 2),
                "scrapes": scrapes[name],
            }
            for name in MEASURED
        },
        "page_bytes": by_name["every 1 s"].page_bytes,
        "otlp_spans_received": spans_received,
        **burst,
        "runner_cpu_share_loaded_percent": round(100 * loaded_share, 1),
        "scrape_every_15s_percent_of_runner_cpu": round(100 * per_scrape / 15 / loaded_share, 4),
        "scrape_every_1s_percent_of_runner_cpu": round(100 * per_scrape / 1 / loaded_share, 3),
    }  # fmt: skip


async def scrape_burst(
    session: aiohttp.ClientSession, pipelines: list[Pipeline], count: int
) -> dict[str, Any]:
    """`count` scrapes back to back of the idle 1-s runner; its CPU over them less the idle
    unscraped runner's over the same time."""
    scraped = next(p for p in pipelines if p.name == "every 1 s")
    idle = next(p for p in pipelines if p.name == "none")
    cpu0, idle0 = sample(scraped.pid).cpu_seconds, sample(idle.pid).cpu_seconds
    began = time.monotonic()
    for _ in range(count):
        await scrape(session, scraped)
    elapsed = time.monotonic() - began
    cpu = sample(scraped.pid).cpu_seconds - cpu0 - (sample(idle.pid).cpu_seconds - idle0)
    return {
        "burst_scrapes": count, "burst_seconds": round(elapsed, 2),
        "cpu_ms_per_scrape": round(1000 * cpu / count, 3),
    }  # fmt: skip


def report(result: dict[str, Any]) -> None:
    table = Table(title="runners side by side (same load, one run)", title_justify="left")
    for column in ("runner", "CPU s", "vs none", "scrapes"):
        table.add_column(column, justify="left" if column == "runner" else "right")
    for name, figures in result["runners"].items():
        table.add_row(
            name, f"{figures['cpu_seconds']:.2f}", f"{figures['vs_none_percent']:+.2f}%",
            str(figures["scrapes"]),
        )  # fmt: skip
    console.print(table)
    other = Table(title="one scrape, measured directly", title_justify="left", show_header=False)
    for key, value in result.items():
        if key != "runners":
            other.add_row(key, str(value))
    console.print(other)


if __name__ == "__main__":
    parser = benchmark_parser(__doc__)
    parser.add_argument("--rate", type=int, default=20, help="rollouts/s queued per runner")
    parser.add_argument("--seconds", type=int, default=120, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=32, help="rollouts at once per runner")
    parser.add_argument("--burst", type=int, default=2000, help="scrapes in the direct measure")
    run_benchmark(parser, main, report)
