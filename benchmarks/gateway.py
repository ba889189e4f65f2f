"""The gateway's cost: calls straight to an upstream and the same calls through `agl-stream
gateway` (which records each one as a span on the broker), side by side in one run.

    .venv/bin/python -m benchmarks.gateway --calls 400 --concurrency 16

The upstream is benchmarks.stub_upstream (answers at once, 32 tokens with ids and logprobs),
or `--upstream tiny` for `agl-stream serve --model tiny-chat`. Each runs in its own process,
as does the gateway. Latency: one call at a time, direct and through the gateway alternating,
streaming and not; p50/p99 of each and of the difference. Throughput: --concurrency callers
for --calls calls, direct then through the gateway. Needs the embedded stack (`make up`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from rich.console import Console
from rich.table import Table

from agl_stream.embedded.process import free_port
from agl_stream.runtime.config import child_environment
from benchmarks.runners import percentile
from benchmarks.stack import fresh_topics, run_benchmark

console = Console()
MESSAGES = [{"role": "user", "content": "How many letters are in the word 'gateway'?"}]


@asynccontextmanager
async def process(args: list[str], port: int, env: dict[str, str]) -> AsyncIterator[str]:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", *args, env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}/v1"
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(600):
                try:
                    async with session.post(f"{base}/chat/completions", json=body(False)):
                        break
                except aiohttp.ClientError:
                    await asyncio.sleep(0.1)
            else:
                raise RuntimeError(f"{args} did not start")
        yield base
    finally:
        child.terminate()
        await child.wait()


def body(stream: bool) -> dict[str, object]:
    return {"model": "policy", "messages": MESSAGES, "max_tokens": 32, "stream": stream}


async def call(session: aiohttp.ClientSession, base: str, stream: bool) -> float:
    started = time.perf_counter()
    async with session.post(f"{base}/chat/completions", json=body(stream)) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{base} answered {response.status}")
    return time.perf_counter() - started


async def latencies(direct: str, gateway: str, calls: int, stream: bool) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"direct": [], "gateway": [], "added": []}
    async with aiohttp.ClientSession() as session:
        for _ in range(calls):
            d = await call(session, direct, stream)
            g = await call(session, gateway, stream)
            out["direct"].append(d)
            out["gateway"].append(g)
            out["added"].append(g - d)
    return out


async def throughput(base: str, calls: int, concurrency: int, stream: bool) -> float:
    remaining = calls

    async def caller(session: aiohttp.ClientSession) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await call(session, base, stream)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.perf_counter()
        await asyncio.gather(*(caller(session) for _ in range(concurrency)))
        return calls / (time.perf_counter() - started)


async def main(args: argparse.Namespace) -> dict[str, object]:
    _, kafka = await fresh_topics(f"bench-{uuid.uuid4().hex[:6]}")
    env = child_environment(kafka)
    up_port, gw_port = free_port(), free_port()
    if args.upstream == "tiny":
        upstream = ["agl_stream.cli.main", "serve", "--model", "tiny-chat", "--port", str(up_port)]
    else:
        upstream = ["benchmarks.stub_upstream", "--port", str(up_port)]
    gateway = ["agl_stream.cli.main", "gateway", "--port", str(gw_port), "--upstream"]
    results: dict[str, object] = {"upstream": args.upstream, "calls": args.calls}
    direct = f"http://127.0.0.1:{up_port}/v1"
    async with (
        process(upstream, up_port, env),
        process([*gateway, direct], gw_port, env) as through,
    ):
        for stream in (False, True):
            mode = "stream" if stream else "whole"
            with console.status(f"latency, {mode}: {args.latency_calls} calls each way..."):
                lat = await latencies(direct, through, args.latency_calls, stream)
            with console.status(f"throughput, {mode}: {args.calls} calls each way..."):
                rate_direct = await throughput(direct, args.calls, args.concurrency, stream)
                rate_gateway = await throughput(through, args.calls, args.concurrency, stream)
            results[mode] = {
                **{
                    f"{k}_ms_p{int(q * 100)}": percentile(v, q) * 1000
                    for k, v in lat.items()
                    for q in (0.5, 0.99)
                },
                "direct_calls_per_s": rate_direct,
                "gateway_calls_per_s": rate_gateway,
                "ratio": rate_gateway / rate_direct,
            }
    return results


def show(results: dict[str, object]) -> None:
    table = Table(title=f"gateway vs direct (upstream: {results['upstream']})")
    for column in ("", "direct p50/p99 ms", "gateway p50/p99 ms", "added p50/p99 ms",
                   "direct calls/s", "gateway calls/s", "ratio"):  # fmt: skip
        table.add_column(column, justify="right")
    for mode in ("whole", "stream"):
        r = results[mode]
        assert isinstance(r, dict)
        table.add_row(
            mode,
            f"{r['direct_ms_p50']:.2f} / {r['direct_ms_p99']:.2f}",
            f"{r['gateway_ms_p50']:.2f} / {r['gateway_ms_p99']:.2f}",
            f"{r['added_ms_p50']:.2f} / {r['added_ms_p99']:.2f}",
            f"{r['direct_calls_per_s']:.0f}",
            f"{r['gateway_calls_per_s']:.0f}",
            f"{r['ratio']:.2f}",
        )
    console.print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=400, help="calls per throughput run")
    parser.add_argument("--latency-calls", type=int, default=200, help="calls per latency run")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--upstream", choices=("stub", "tiny"), default="stub")
    run_benchmark(parser, main, show)
