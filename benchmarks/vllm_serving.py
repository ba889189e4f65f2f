"""The policy server's vLLM engine beside vLLM called directly and beside the torch engine,
in one run on one machine:

    .venv/bin/python -m benchmarks.vllm_serving

1. Tokens/s: --clients clients, each sending --requests completions of --tokens tokens one
   after the other (greedy; a prompt of its own each, so no answer comes from another's
   cached prefix), to vLLM's own server (the one `serve --engine vllm` started, called at
   its address as a client of vLLM would: text in, ids and logprobs asked for), to
   `serve --engine vllm`'s API, and to `serve --engine torch`, on the same checkpoint
   (tiny-chat-h32): the median of --rounds rounds. Direct and front take turns on the same
   vLLM, each going first every other round; the front's share is the median of the rounds'
   ratios.
2. Reload latency: a new checkpoint published on the resources topic -> the first answer
   by it, for a call that names the new version (as a runner's gateway does, so the call
   waits for the load): --reloads versions per engine.
3. With --steps N: the demo's step (benchmarks.step_latency) with each engine.

Both servers run as `agl-stream serve` processes following fresh topics of the embedded
stack (started if it is not running); one engine runs at a time.
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.table import Table

from agl_stream.commands.resources import Change, publish_resources
from agl_stream.embedded.process import free_port
from agl_stream.events import Checkpoint
from agl_stream.gateway.routes import RESOURCES_HEADER
from agl_stream.runtime.config import KafkaSettings, child_environment
from agl_stream.serving.vllm_placement import PLACEMENTS
from agl_stream.training.model import content_hash, initial_policy, save_policy
from benchmarks.stack import benchmark_parser, fresh_topics, run_benchmark

console = Console()
MODEL = "tiny-chat-h32"
ENGINES = ("torch", "vllm")
WAITING = "front's process waiting for a CPU (share of its rounds)"


def checkpoint(root: Path, seed: int) -> Checkpoint:
    directory = root / f"seed-{seed}"
    if not directory.exists():
        save_policy(initial_policy(MODEL, seed), directory)
    return Checkpoint(uri=directory.as_uri(), content_hash=content_hash(directory))


async def publish(kafka: KafkaSettings, resources_id: str, policy: Checkpoint) -> None:
    change = Change(resources={"policy": policy}, resources_id=resources_id)
    await publish_resources(kafka, change, published_by="benchmark")


async def health(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    try:
        async with session.get(f"{url}/health") as response:
            body: dict[str, Any] = await response.json()
            return body
    except (aiohttp.ClientError, ValueError):
        return {}


async def serving(session: aiohttp.ClientSession, url: str, resources_id: str) -> dict[str, Any]:
    while (state := await health(session, url)).get("resources_id") != resources_id:
        if resources_id in state.get("refused", {}):
            raise RuntimeError(f"{resources_id} refused: {state['refused'][resources_id]}")
        await asyncio.sleep(0.2)
    return state


@dataclass(frozen=True)
class Leg:
    tokens_per_second: float
    prompt_tokens: float  # a call's, on average
    completion_tokens: float


async def load(
    url: str,
    model: str,
    clients: int,
    requests: int,
    tokens: int,
    tag: str,
    extra: dict[str, Any],
    tokenizer: Any = None,
) -> Leg:
    """Tokens/s of `clients` clients sending `requests` completions each (with `tokenizer`:
    the prompt as the token ids the policy server would send, not as text)."""
    return await load_many([(url, model)], clients, requests, tokens, tag, extra, tokenizer)


async def load_many(
    targets: Sequence[tuple[str, str]],
    clients: int,
    requests: int,
    tokens: int,
    tag: str,
    extra: Mapping[str, Any] | None = None,
    tokenizer: Any = None,
) -> Leg:
    """`load`, client i calling target i mod len(targets) (a server's URL, a model name)."""
    generated = prompted = 0

    async def client(session: aiohttp.ClientSession, index: int) -> None:
        nonlocal generated, prompted
        url, model = targets[index % len(targets)]
        for n in range(requests):
            body = {
                "model": model, "prompt": f"{tag} client {index} request {n}:",
                "max_tokens": tokens, "temperature": 0, **(extra or {}),
            }  # fmt: skip
            if tokenizer is not None:
                body["prompt"] = tokenizer(body["prompt"], add_special_tokens=False)["input_ids"]
            async with session.post(f"{url}/v1/completions", json=body) as response:
                answer = await response.json()
                assert response.status == 200, answer
            generated += int(answer["usage"]["completion_tokens"])
            prompted += int(answer["usage"]["prompt_tokens"])

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        began = time.perf_counter()
        await asyncio.gather(*(client(session, i) for i in range(clients)))
        seconds = time.perf_counter() - began
    calls = clients * requests
    return Leg(generated / seconds, prompted / calls, generated / calls)


async def reload_latency(
    session: aiohttp.ClientSession, kafka: KafkaSettings, url: str, root: Path, engine: str,
    count: int,
) -> list[float]:  # fmt: skip
    """Seconds from publishing each version to its first answer."""
    out = []
    for n in range(count):
        name = f"{engine}-reload-{n}-{uuid.uuid4().hex[:6]}"
        policy = checkpoint(root, 100 + n)
        body = {"model": "policy", "prompt": "hello", "max_tokens": 1, "temperature": 0}
        began = time.perf_counter()
        await publish(kafka, name, policy)
        while True:  # a call naming the version waits (up to 10 s) for its load
            async with session.post(
                f"{url}/v1/completions", json=body, headers={RESOURCES_HEADER: name}
            ) as response:
                answer = await response.json()
            if answer.get("system_fingerprint") == name:
                break
        out.append(time.perf_counter() - began)
    return out


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds (user and system) of the process `pid` and of its descendants (vLLM's)."""
    import psutil

    parent = psutil.Process(pid)
    own = sum(parent.cpu_times()[:2])
    children = 0.0
    for child in parent.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            children += sum(child.cpu_times()[:2])
    return own, children


def run_queue_seconds(pid: int) -> float:
    """Seconds the threads of process `pid` have spent runnable but waiting for a CPU
    (/proc/PID/task/*/schedstat: its second field, in nanoseconds)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            total += int((task / "schedstat").read_text().split()[1])
    return total / 1e9


def start_server(
    engine: str, kafka: KafkaSettings, log: Path, scheduler: str = "auto"
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [sys.executable, "-m", "agl_stream.cli.main", "serve", "--engine", engine,
               "--port", str(port)]  # fmt: skip
    if engine == "vllm":
        command += ["--vllm-scheduler", scheduler]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, env=child_environment(kafka), stdout=out, stderr=subprocess.STDOUT
        )
    return process, f"http://127.0.0.1:{port}"


async def measure_engine(
    engine: str, args: argparse.Namespace, root: Path, figures: dict[str, Any]
) -> None:
    _, kafka = await fresh_topics(f"bench-serving-{engine}-{uuid.uuid4().hex[:6]}")
    process, url = start_server(engine, kafka, root / f"serve-{engine}.log", args.vllm_scheduler)
    try:
        async with aiohttp.ClientSession() as session:
            while not await health(session, url):
                if process.poll() is not None:
                    raise RuntimeError(f"serve --engine {engine} stopped: see {root}")
                await asyncio.sleep(0.2)
            began = time.perf_counter()
            first = f"{engine}-first-{uuid.uuid4().hex[:6]}"
            await publish(kafka, first, checkpoint(root, 0))
            state = await serving(session, url, first)
            figures[f"{engine}: first version served after (s)"] = round(
                time.perf_counter() - began, 1
            )
            load_args = (args.clients, args.requests, args.tokens)
            await load(url, "policy", 2, 2, args.tokens, "warm-up", {})
            if engine == "vllm":
                direct: list[Leg] = []
                front: list[Leg] = []
                front_cpu: list[float] = []  # CPU seconds of the front's process a round
                vllm_cpu: list[float] = []  # and of vLLM's processes
                front_waiting: list[float] = []  # the front's share of a round spent runnable
                direct_extra = {"logprobs": 0, "return_token_ids": True}
                as_ids = initial_policy(MODEL, 0).tokenizer if args.direct_ids else None
                for round_ in range(args.rounds):
                    # Alternating which goes first, so a drift of the machine's load
                    # favours neither.
                    pair = [
                        (direct, state["engine_url"], "base", f"d{round_}", direct_extra, as_ids),
                        (front, url, "policy", f"f{round_}", {}, None),
                    ][:: 1 if round_ % 2 == 0 else -1]
                    for legs, at, model, tag, extra, ids in pair:
                        before = cpu_seconds(process.pid)
                        waited, began = run_queue_seconds(process.pid), time.perf_counter()
                        legs.append(await load(at, model, *load_args, tag, extra, ids))
                        if legs is front:
                            front_cpu.append(cpu_seconds(process.pid)[0] - before[0])
                            vllm_cpu.append(cpu_seconds(process.pid)[1] - before[1])
                            front_waiting.append(
                                (run_queue_seconds(process.pid) - waited)
                                / (time.perf_counter() - began)
                            )
                for name, legs in (("vLLM direct", direct), ("serve --engine vllm", front)):
                    figures[f"tokens/s {name}"] = round(
                        statistics.median(leg.tokens_per_second for leg in legs)
                    )
                    # Tokens/s counts what was generated: the same only for the same lengths.
                    figures[f"tokens a call {name}"] = (  # prompt, completion
                        round(statistics.mean(leg.prompt_tokens for leg in legs), 2),
                        round(statistics.mean(leg.completion_tokens for leg in legs), 2),
                    )
                requests = args.clients * args.requests
                figures["front CPU ms per call"] = round(
                    1000 * statistics.median(front_cpu) / requests, 2
                )
                figures["vLLM CPU ms per call (via the front)"] = round(
                    1000 * statistics.median(vllm_cpu) / requests, 2
                )
                figures[WAITING] = round(statistics.median(front_waiting), 3)
                pairs = [
                    (d.tokens_per_second, f.tokens_per_second)
                    for d, f in zip(direct, front, strict=True)
                ]
                figures["rounds (direct, front) tokens/s"] = [
                    (round(d), round(f)) for d, f in pairs
                ]
                figures["front / direct"] = round(statistics.median(f / d for d, f in pairs), 3)
            else:
                legs = [
                    await load(url, "policy", *load_args, f"t{round_}", {})
                    for round_ in range(args.rounds)
                ]
                figures["tokens/s serve --engine torch"] = round(
                    statistics.median(leg.tokens_per_second for leg in legs)
                )
            seconds = await reload_latency(session, kafka, url, root, engine, args.reloads)
            figures[f"{engine}: reload, publish -> first answer, median (s)"] = round(
                statistics.median(seconds), 3
            )
            figures[f"{engine}: reload, publish -> first answer, max (s)"] = round(max(seconds), 3)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


async def main(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="agl-bench-vllm-"))
    figures: dict[str, Any] = {
        "model": MODEL, "clients": args.clients, "requests_per_client": args.requests,
        "tokens_per_request": args.tokens, "rounds": args.rounds,
        "direct prompt": "token ids" if args.direct_ids else "text",
        "--vllm-scheduler": args.vllm_scheduler,
    }  # fmt: skip
    for engine in ("vllm", "torch"):
        await measure_engine(engine, args, root, figures)
    if args.steps:
        from benchmarks import step_latency

        for engine in ENGINES:
            step_args = argparse.Namespace(
                steps=args.steps, runners=2, concurrency=32, seed=0, max_staleness=0,
                engine=engine,
            )  # fmt: skip
            steps = await step_latency.main(step_args)
            for key in ("step_median_s", "sampling_median_s", "wall_s",
                        "first_tenth_reward", "last_tenth_reward"):  # fmt: skip
                figures[f"demo step ({engine}): {key}"] = steps[key]
    return figures


def report(figures: dict[str, Any]) -> None:
    table = Table(
        title=f"serving {figures['model']}: {figures['clients']} clients x "
        f"{figures['requests_per_client']} completions of {figures['tokens_per_request']} "
        f"tokens (median of {figures['rounds']} rounds)",
        title_justify="left",
    )
    for column in ("vLLM direct", "serve --engine vllm", "serve --engine torch"):
        table.add_column(column, justify="right")
    table.add_row(
        f"{figures['tokens/s vLLM direct']} tokens/s",
        f"{figures['tokens/s serve --engine vllm']} tokens/s "
        f"({figures['front / direct']:.0%} of direct)",
        f"{figures['tokens/s serve --engine torch']} tokens/s",
    )
    table.add_row(
        *(
            "prompt {}, completion {} tokens a call".format(*figures[f"tokens a call {name}"])
            for name in ("vLLM direct", "serve --engine vllm")
        ),
        "",
    )
    console.print(table)
    console.print(
        f"the front's own CPU: {figures['front CPU ms per call']} ms a call; vLLM's processes: "
        f"{figures['vLLM CPU ms per call (via the front)']} ms a call (its worker spins while "
        "it waits, so this grows with the wall time); the front's process waited for a CPU "
        f"{figures[WAITING]:.0%} of the time",
        highlight=False,
    )
    side = Table(title="the same, per engine", title_justify="left")
    side.add_column("")
    for engine in ENGINES:
        side.add_column(engine, justify="right")
    rows = sorted({key.split(": ", 1)[1] for key in figures if key.startswith(ENGINES)})
    for row in rows:
        values = [str(figures.get(f"{engine}: {row}", "")) for engine in ENGINES]
        side.add_row(row, *values)
    for key in ("step_median_s", "sampling_median_s", "wall_s", "first_tenth_reward",
                "last_tenth_reward"):  # fmt: skip
        if f"demo step (torch): {key}" in figures:
            side.add_row(
                f"demo: {key}", *(str(figures[f"demo step ({e}): {key}"]) for e in ENGINES)
            )
    console.print(side)


if __name__ == "__main__":
    parser = benchmark_parser(__doc__)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--reloads", type=int, default=5)
    parser.add_argument("--steps", type=int, default=0, help="also the demo's step (0: not)")
    parser.add_argument(
        "--direct-ids",
        action="store_true",
        help="call vLLM directly with the prompt's token ids, as the front does (default: text)",
    )
    parser.add_argument(
        "--vllm-scheduler",
        choices=PLACEMENTS,
        default="auto",
        help="serve's --vllm-scheduler (vllm: where vLLM puts its scheduler, as before it moved)",
    )
    run_benchmark(parser, main, report)
