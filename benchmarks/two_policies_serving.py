"""The cost of a second policy on the same base: two LoRA adapters in one vLLM against two
vLLM servers, side by side in one run:

    .venv/bin/python -m benchmarks.two_policies_serving

Two policies are two LoRA adapters (rank --rank, every linear layer, random weights) of one
base (--model). Served two ways, one after the other, each as `agl-stream serve --engine
vllm` processes following fresh topics of the embedded stack (started if it is not running):

1. adapters: one `serve --policy a --policy b`: one vLLM on the base, each policy an adapter
   in it (the way policies that share a base are served);
2. two servers: a `serve --resource a` and a `serve --resource b`, each its own vLLM
   serving its policy merged into the base (`--vllm-lora merge`, the faster way to serve a
   single adapter on vLLM's CPU build).

For each: seconds from publishing the version to both policies answering, tokens/s of
--clients clients (half calling each policy) sending --requests completions of --tokens
tokens each (greedy, a prompt of their own), the median of --rounds rounds, and memory: the
proportional set size (PSS: shared pages split between the processes sharing them) of every
process of the servers, at its highest while the load ran. Each policy's greedy answers to
a fixed prompt are compared between the two ways (the same weights: the same tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.table import Table

from agl_stream.commands.resources import Change, publish_resources
from agl_stream.embedded.process import free_port
from agl_stream.events import Checkpoint
from agl_stream.runtime.config import KafkaSettings, child_environment
from agl_stream.training.model import content_hash
from benchmarks.stack import benchmark_parser, fresh_topics, run_benchmark
from benchmarks.vllm_serving import health, load_many

console = Console()
POLICIES = ("a", "b")
WAYS = ("adapters", "two servers")
PROBE = "The capital of France is"


def base_model(spec: str, root: Path) -> Path:
    """The base's directory: a pretrained model's converted folder, or a tiny one saved."""
    from agl_stream.training.model import initial_policy, save_policy
    from agl_stream.training.pretrained import is_pretrained, resolve_model

    if is_pretrained(spec):
        return resolve_model(spec)
    directory = root / "base"
    save_policy(initial_policy(spec, 0), directory)
    return directory


def adapter(base: Path, directory: Path, rank: int, seed: int) -> Checkpoint:
    """A LoRA adapter of `base` with random weights (a fresh one changes nothing)."""
    import torch

    from agl_stream.training.lora import LoraSettings, with_adapter
    from agl_stream.training.model import load_policy, save_policy

    torch.manual_seed(seed)
    policy = with_adapter(load_policy(base), LoraSettings(rank=rank))
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.02)
    save_policy(policy, directory)
    return Checkpoint(
        uri=directory.as_uri(), content_hash=content_hash(directory), format="peft",
        base_uri=base.as_uri(), base_content_hash=content_hash(base),
    )  # fmt: skip


def start_serve(
    kafka: KafkaSettings, root: Path, n: int, options: Sequence[str]
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [sys.executable, "-m", "agl_stream.cli.main", "serve", "--engine", "vllm",
               "--port", str(port), "--vllm-log", str(root / f"vllm-{n}.log"),
               *options]  # fmt: skip
    with (root / f"serve-{n}.log").open("wb") as out:
        process = subprocess.Popen(
            command, env=child_environment(kafka), stdout=out, stderr=subprocess.STDOUT
        )
    return process, f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def servers(
    kafka: KafkaSettings, root: Path, commands: Sequence[Sequence[str]]
) -> AsyncIterator[list[tuple[subprocess.Popen[bytes], str]]]:
    """`agl-stream serve` processes (each `--engine vllm` plus its options), listening."""
    started = []
    try:
        for n, options in enumerate(commands):
            started.append(start_serve(kafka, root, n, options))
        async with aiohttp.ClientSession() as session:
            for process, url in started:
                while not await health(session, url):
                    if process.poll() is not None:
                        raise RuntimeError(f"a serve process stopped: see {root}")
                    await asyncio.sleep(0.2)
        yield started
    finally:
        for process, _ in started:
            process.terminate()
        for process, _ in started:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


async def all_serving(
    session: aiohttp.ClientSession,
    started: Sequence[tuple[subprocess.Popen[bytes], str]],
    wanted: str,
    within: float = 900.0,
) -> None:
    """Until every server serves `wanted` for each of its policies (a refusal, a server that
    stopped or `within` seconds passing is an error)."""

    def served(state: dict[str, Any]) -> bool:
        policies = state.get("policies") or {"": state}
        refused = [p["refused"][wanted] for p in policies.values() if wanted in p["refused"]]
        if refused:
            raise RuntimeError(f"{wanted} refused: {refused}")
        return all(p["resources_id"] == wanted for p in policies.values())

    deadline = time.monotonic() + within
    for process, url in started:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the serve at {url} stopped (exit {process.returncode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{wanted} was not served within {within:.0f} s")
            if served(await health(session, url) or {"resources_id": None, "refused": {}}):
                break
            await asyncio.sleep(0.2)


def pss_bytes(pids: Sequence[int]) -> int:
    """PSS of the processes `pids` and their descendants (vLLM's), in bytes."""
    import psutil

    total = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            parent = psutil.Process(pid)
            for process in (parent, *parent.children(recursive=True)):
                with contextlib.suppress(psutil.Error):
                    total += process.memory_full_info().pss
    return total


async def probe(url: str, model: str) -> list[int]:
    body = {"model": model, "prompt": PROBE, "max_tokens": 8, "temperature": 0}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/completions", json=body) as response,
    ):
        answer = await response.json()
        assert response.status == 200, answer
        return [int(t) for t in answer["choices"][0]["token_ids"]]


async def measure(
    way: str, args: argparse.Namespace, root: Path, checkpoints: dict[str, Checkpoint]
) -> dict[str, Any]:
    _, kafka = await fresh_topics(f"bench-two-serving-{uuid.uuid4().hex[:6]}")
    common = ["--vllm-max-lora-rank", str(args.rank)]
    if way == "adapters":
        commands = [[*common, *(o for p in POLICIES for o in ("--policy", p))]]
    else:
        commands = [
            [*common, "--resource", p, "--served-model-name", p, "--vllm-lora", "merge"]
            for p in POLICIES
        ]
    figures: dict[str, Any] = {}
    async with servers(kafka, root / way.replace(" ", "-"), commands) as started:
        urls = [url for _, url in started]
        targets = [(urls[0 if way == "adapters" else n], p) for n, p in enumerate(POLICIES)]
        pids = [process.pid for process, _ in started]
        resources_id = f"two-{uuid.uuid4().hex[:6]}"
        began = time.perf_counter()
        await publish_resources(
            kafka, Change(resources=dict(checkpoints), resources_id=resources_id), "benchmark"
        )
        async with aiohttp.ClientSession() as session:
            await all_serving(session, started, resources_id)
        figures["both policies served after (s)"] = round(time.perf_counter() - began, 1)
        figures["probe"] = {p: await probe(url, p) for url, p in targets}
        await load_many(targets, 2, 2, args.tokens, "warm-up")
        peak = pss_bytes(pids)
        sampling = True

        async def sample() -> None:
            nonlocal peak
            while sampling:
                peak = max(peak, await asyncio.to_thread(pss_bytes, pids))
                await asyncio.sleep(0.5)

        sampler = asyncio.create_task(sample())
        rounds = []
        for round_ in range(args.rounds):
            leg = await load_many(targets, args.clients, args.requests, args.tokens, f"r{round_}")
            rounds.append(leg.tokens_per_second)
        sampling = False
        await sampler
        figures["tokens/s"] = round(statistics.median(rounds))
        figures["rounds tokens/s"] = [round(r) for r in rounds]
        figures["memory, PSS at its highest (GiB)"] = round(peak / 2**30, 2)
        figures["processes"] = len(pids)
    return figures


async def main(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="agl-bench-two-serving-"))
    for way in WAYS:
        (root / way.replace(" ", "-")).mkdir()
    base = base_model(args.model, root)
    checkpoints = {
        p: adapter(base, root / f"adapter-{p}", args.rank, seed) for seed, p in enumerate(POLICIES)
    }
    figures: dict[str, Any] = {
        "model": args.model, "lora rank": args.rank, "clients": args.clients,
        "requests_per_client": args.requests, "tokens_per_request": args.tokens,
        "rounds": args.rounds,
    }  # fmt: skip
    for way in WAYS:
        for key, value in (await measure(way, args, root, checkpoints)).items():
            figures[f"{way}: {key}"] = value
    probes = [figures.pop(f"{way}: probe") for way in WAYS]
    figures["the same answers both ways"] = probes[0] == probes[1]
    figures["adapters / two servers, tokens/s"] = round(
        figures["adapters: tokens/s"] / figures["two servers: tokens/s"], 3
    )
    figures["adapters / two servers, memory"] = round(
        figures["adapters: memory, PSS at its highest (GiB)"]
        / figures["two servers: memory, PSS at its highest (GiB)"],
        3,
    )
    return figures


def report(figures: dict[str, Any]) -> None:
    table = Table(
        title=f"two policies (LoRA rank {figures['lora rank']}) on {figures['model']}: "
        f"{figures['clients']} clients x {figures['requests_per_client']} completions of "
        f"{figures['tokens_per_request']} tokens, half to each policy (median of "
        f"{figures['rounds']} rounds)",
        title_justify="left",
    )
    table.add_column("")
    for way in WAYS:
        table.add_column(way, justify="right")
    table.add_column("adapters / two servers", justify="right")
    rows = [
        ("vLLM processes trees", "processes", None),
        ("both served after (s)", "both policies served after (s)", None),
        ("tokens/s", "tokens/s", "adapters / two servers, tokens/s"),
        ("memory, PSS (GiB)", "memory, PSS at its highest (GiB)", "adapters / two servers, memory"),
    ]
    for label, key, ratio in rows:
        table.add_row(
            label, *(str(figures[f"{way}: {key}"]) for way in WAYS),
            str(figures[ratio]) if ratio else "",
        )  # fmt: skip
    console.print(table)
    same = "the same" if figures["the same answers both ways"] else "DIFFERENT"
    console.print(f"each policy's greedy answer to a fixed prompt: {same} both ways")


if __name__ == "__main__":
    parser = benchmark_parser(__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    run_benchmark(parser, main, report)
