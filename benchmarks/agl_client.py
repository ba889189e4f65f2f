"""Agent Lightning's own store benchmark, its client's workload ("batch" mode of
tests/benchmark/benchmark_store.py in microsoft/agent-lightning v0.3.0) reproduced, run on
two stores one after the other, in alternate rounds: Agent Lightning's in-memory store served
by `agl store`, and `agl-stream store` on a private embedded stack (topics and a database of
its own each round).

The client is Agent Lightning's Trainer with its runner processes and an algorithm that, per
batch, publishes an LLM resource, enqueues the batch's tasks, then polls `wait_for_rollouts`
(timeout 0) and checks each finished rollout (succeeded; its spans hold the task and a final
reward in [1, 2]) until the batch is done. The agent runs 1 to --max-rounds rounds of a span
with two nested spans (random flattened attributes, a random sleep up to --sleep-seconds), a
reward in half of the rounds, a final span and a final reward. Every task's draws come from
--seed and the task's name, so both stores see the same work.

Per store: the fit's wall time, rollouts/s, and CPU seconds per rollout of the store side (the
server's process tree; for agl-stream also the broker and PostgreSQL started for it) and of
the client side (the Trainer's process and its runners), all counted over the fit alone.

    .venv/bin/python -m benchmarks.agl_client --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import signal
import statistics
import string
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from agl_stream.db.migrate import migrate
from agl_stream.embedded.process import free_port
from agl_stream.embedded.stack import StackState
from agl_stream.runtime.config import DatabaseSettings, child_environment, load
from benchmarks.stack import benchmark_parser, fresh_topics, private_stack, run_benchmark

MARK = "agl-client-bench:"  # the client's lines that the benchmark reads on its stdout
STORES = ("agl", "agl-stream")
LETTERS = string.ascii_letters + string.digits


@dataclass(frozen=True)
class Workload:
    tasks: int
    batch_size: int
    runners: int
    max_rounds: int
    sleep_seconds: float
    poll_seconds: float
    seed: int
    stall_seconds: float = 300.0  # a batch with no rollout finished for this long fails the run


# ---- the workload: Agent Lightning's side, run in the client process --------------------


def _text(rng: random.Random, low: int, high: int) -> str:
    return "".join(rng.choices(LETTERS, k=rng.randint(low, high)))


def _nested(rng: random.Random, depth: int) -> dict[str, Any]:
    """A dict of 2-6 keys (3-20 characters), each a text of 5-300 characters or, above the
    last level, sometimes a dict of its own."""
    return {
        _text(rng, 3, 20): _nested(rng, depth - 1)
        if depth > 1 and rng.random() < 0.5
        else _text(rng, 5, 300)
        for _ in range(rng.randint(2, 6))
    }


def _flattened(values: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            flat.update(_flattened(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def span_attributes(rng: random.Random) -> dict[str, str]:
    return _flattened(_nested(rng, rng.randint(1, 3)))


def make_agent(workload: Workload) -> Any:
    import agentlightning as agl
    from agentlightning.utils.otel import get_tracer

    async def agent(task: str, llm: agl.LLM) -> None:
        rng = random.Random(f"{workload.seed}:{task}")
        tracer = get_tracer()
        rounds = rng.randint(1, workload.max_rounds)
        with_task = rng.randrange(rounds)
        for i in range(rounds):
            with tracer.start_as_current_span(f"agent{i}"):
                with tracer.start_as_current_span(f"round{i}_1") as span:
                    await asyncio.sleep(rng.uniform(0, workload.sleep_seconds))
                    span.set_attributes(span_attributes(rng))
                    if i == with_task:
                        span.set_attribute("task", task)
                with tracer.start_as_current_span(f"round{i}_2") as span:
                    await asyncio.sleep(rng.uniform(0, workload.sleep_seconds))
                    span.set_attributes(span_attributes(rng))
            if rng.random() < 0.5:
                agl.emit_reward(rng.uniform(0, 1))
        with tracer.start_as_current_span("final") as span:
            await asyncio.sleep(rng.uniform(0, workload.sleep_seconds))
            span.set_attributes(span_attributes(rng))
        agl.emit_reward(rng.uniform(1, 2))

    return agl.rollout(agent)


def check_rollout(rollout: Any, spans: list[Any], task: str) -> None:
    """What the original checks of each finished rollout."""
    import agentlightning as agl

    if rollout.status != "succeeded":
        raise RuntimeError(f"rollout {rollout.rollout_id} ({task}) ended {rollout.status}")
    if not any(span.attributes.get("task") == task for span in spans):
        raise RuntimeError(f"no span of rollout {rollout.rollout_id} names its task {task}")
    reward = agl.find_final_reward(spans)
    if reward is None or not 1 <= reward <= 2:
        raise RuntimeError(f"rollout {rollout.rollout_id}: final reward {reward}, not in [1, 2]")


def batch_algorithm(workload: Workload) -> Any:
    import agentlightning as agl

    class BatchAlgorithm(agl.Algorithm):  # type: ignore[misc]  # Agent Lightning is untyped
        """Enqueue a batch, poll until all of it is done and checked, then the next."""

        async def run(self, train_dataset: Any = None, val_dataset: Any = None) -> None:
            store = self.get_store()
            for first in range(0, workload.tasks, workload.batch_size):
                await store.add_resources(
                    {"llm": agl.LLM(endpoint=f"http://localhost:{first}/v1", model=f"m-{first}")}
                )
                batch: dict[str, str] = {}
                for n in range(first, min(first + workload.batch_size, workload.tasks)):
                    rollout = await store.enqueue_rollout(input=f"task-{n}", mode="train")
                    batch[rollout.rollout_id] = f"task-{n}"
                await self.wait_checked(store, batch)

        async def wait_checked(self, store: Any, batch: dict[str, str]) -> None:
            done: set[str] = set()
            progressed = time.monotonic()
            while len(done) < len(batch):
                finished = await store.wait_for_rollouts(rollout_ids=list(batch), timeout=0.0)
                for rollout in finished:
                    if rollout.rollout_id in done:
                        continue
                    spans = await store.query_spans(rollout.rollout_id, attempt_id="latest")
                    check_rollout(rollout, spans, batch[rollout.rollout_id])
                    done.add(rollout.rollout_id)
                    progressed = time.monotonic()
                if time.monotonic() - progressed > workload.stall_seconds:
                    raise RuntimeError(f"{len(batch) - len(done)} rollouts stalled")
                await asyncio.sleep(workload.poll_seconds)

    return BatchAlgorithm()


def _cpu_of_this_process() -> float:
    """CPU seconds of this process and the children it has waited for (its runners)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _client(url: str, workload: Workload) -> None:
    """The benchmark's client: Agent Lightning's Trainer on the store at `url`; says on
    stdout when the fit starts and what it took."""
    import agentlightning as agl

    # Lets Agent Lightning's OTLP exporter (the runners' spans) reach a store with this
    # environment's OpenTelemetry (agl_stream/compat/agl/otlp_compat.py), whichever the store.
    import agl_stream.compat.agl  # noqa: F401

    store = agl.LightningStoreClient(url)
    trainer = agl.Trainer(
        store=store,
        algorithm=batch_algorithm(workload),
        n_runners=workload.runners,
        strategy=agl.ClientServerExecutionStrategy(managed_store=False),
    )
    agent = make_agent(workload)
    print(MARK, json.dumps({"started": True}), flush=True)
    cpu, began = _cpu_of_this_process(), time.perf_counter()
    trainer.fit(agent)
    wall, cpu = time.perf_counter() - began, _cpu_of_this_process() - cpu
    print(MARK, json.dumps({"wall_s": wall, "cpu_s": cpu}), flush=True)
    asyncio.run(store.close())


# ---- the stores and their CPU time ------------------------------------------------------


def cpu_seconds(pids: Mapping[str, int]) -> dict[str, float]:
    """CPU seconds (user and system) used so far by each named process, its descendants and
    the children it has waited for: a difference of two readings is what the tree used in
    between, children that ended in between included."""
    import psutil

    used: dict[str, float] = {}
    for name, pid in pids.items():
        total = 0.0
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(pid)
            for process in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    t = process.cpu_times()
                    total += t.user + t.system + t.children_user + t.children_system
        used[name] = total
    return used


@dataclass
class Served:
    url: str
    pids: dict[str, int]  # the store side's processes by role
    start_s: float


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:]


async def _healthy(url: str, process: asyncio.subprocess.Process, log: Path) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        for _ in range(1200):
            if process.returncode is not None:
                raise SystemExit(f"the store exited ({process.returncode}):\n{_tail(log)}")
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{url}/v1/agl/health") as answer:
                    if answer.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise SystemExit(f"the store at {url} was not healthy in 120 s:\n{_tail(log)}")


@asynccontextmanager
async def serving(
    argv: list[str], env: dict[str, str], log: Path, port: int, others: Mapping[str, int]
) -> AsyncIterator[Served]:
    """A store server started, healthy, and stopped (SIGTERM to its process group) after."""
    url = f"http://127.0.0.1:{port}"
    began = time.perf_counter()
    with log.open("w") as out:
        process = await asyncio.create_subprocess_exec(
            *argv, "--host", "127.0.0.1", "--port", str(port),
            env=env, stdout=out, stderr=out, start_new_session=True,
        )  # fmt: skip
    try:
        await _healthy(url, process, log)
        yield Served(url, {"store server": process.pid, **others}, time.perf_counter() - began)
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), 60)
            except TimeoutError:
                os.killpg(process.pid, signal.SIGKILL)
                await process.wait()


def _environment() -> dict[str, str]:
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    for name in ("AGENT_LIGHTNING_STORE_URL", "AGL_SERVER_HOST", "AGL_SERVER_PORT"):
        env.pop(name, None)
    return env


def _postmaster_pid(home: str) -> int:
    return int((Path(home) / "postgres" / "postmaster.pid").read_text().split()[0])


@asynccontextmanager
async def agl_store(log: Path, port: int) -> AsyncIterator[Served]:
    """Agent Lightning's in-memory store behind its own HTTP server (`agl store`)."""
    agl = str(Path(sys.executable).with_name("agl"))
    async with serving([agl, "store"], _environment(), log, port, {}) as served:
        yield served


@asynccontextmanager
async def agl_stream_store(log: Path, port: int, state: StackState) -> AsyncIterator[Served]:
    """`agl-stream store` on topics and a database of its own on the private stack."""
    run = uuid.uuid4().hex[:8]
    _, kafka = await fresh_topics(f"bench-client-{run}", state)
    database = load(DatabaseSettings, database_url=state.database_url)
    database = database.with_database(f"bench_client_{run}")
    await migrate(database)
    env = {**_environment(), **child_environment(kafka, database)}
    cli = str(Path(sys.executable).with_name("agl-stream"))
    assert state.broker_pid is not None
    processes = {"broker": state.broker_pid, "postgres": _postmaster_pid(state.home)}
    async with serving([cli, "store"], env, log, port, processes) as served:
        yield served


# ---- one round: a store, the client on it -------------------------------------------------


async def _client_run(
    served: Served, workload: Workload, log: Path
) -> tuple[dict[str, Any], dict[str, float]]:
    """Run the client on a store; its figures and the store side's CPU seconds over the fit."""
    argv = [sys.executable, "-m", "benchmarks.agl_client", "--client", served.url,
            *_workload_argv(workload)]  # fmt: skip
    # Its runners' AgentOps would write agentops.log into the working directory.
    env = {**_environment(), "AGENTOPS_LOGGING_TO_FILE": "False"}
    with log.open("w") as err:
        client = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=err, env=env
        )
    assert client.stdout is not None
    before: dict[str, float] = {}
    after: dict[str, float] = {}
    figures: dict[str, Any] = {}
    async for raw in client.stdout:
        line = raw.decode(errors="replace").strip()
        if not line.startswith(MARK):
            continue
        said = json.loads(line[len(MARK) :])
        if said.get("started"):
            before = cpu_seconds(served.pids)
        else:
            after = cpu_seconds(served.pids)
            figures = said
    if await client.wait() != 0 or not figures:
        raise SystemExit(f"the client failed ({client.returncode}):\n{_tail(log)}")
    return figures, {name: after[name] - before[name] for name in served.pids}


def _workload_argv(workload: Workload) -> list[str]:
    return [
        "--tasks", str(workload.tasks), "--batch-size", str(workload.batch_size),
        "--runners", str(workload.runners), "--max-rounds", str(workload.max_rounds),
        "--sleep-seconds", str(workload.sleep_seconds),
        "--poll-seconds", str(workload.poll_seconds), "--seed", str(workload.seed),
    ]  # fmt: skip


async def one_round(
    store: contextlib.AbstractAsyncContextManager[Served], workload: Workload, client_log: Path
) -> dict[str, Any]:
    async with store as served:
        client, store_cpu = await _client_run(served, workload, client_log)
    rollouts = workload.tasks
    return {
        "store_start_s": round(served.start_s, 2),
        "wall_s": round(client["wall_s"], 2),
        "rollouts_per_s": round(rollouts / client["wall_s"], 2),
        "store_cpu_ms_per_rollout": round(1000 * sum(store_cpu.values()) / rollouts, 2),
        "client_cpu_ms_per_rollout": round(1000 * client["cpu_s"] / rollouts, 2),
        "store_cpu_s": {role: round(seconds, 2) for role, seconds in store_cpu.items()},
        "client_cpu_s": round(client["cpu_s"], 2),
    }


def summary(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each store's median over its rounds."""
    keys = ("wall_s", "rollouts_per_s", "store_cpu_ms_per_rollout", "client_cpu_ms_per_rollout")
    return {
        store: {
            key: round(statistics.median(r[key] for r in rounds if r["store"] == store), 2)
            for key in keys
        }
        for store in STORES
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    workload = _workload(args)
    console = Console(stderr=True)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="agl-client-bench-") as tmp, private_stack() as state:
        logs = Path(tmp)  # the servers' and clients' output, shown when one fails
        starts: dict[str, Callable[[Path, int], contextlib.AbstractAsyncContextManager[Served]]]
        starts = {
            "agl": agl_store,
            "agl-stream": lambda log, port: agl_stream_store(log, port, state),
        }
        for number in range(1, args.rounds + 1):
            for name in STORES:
                store = starts[name](logs / f"{name}-{number}-store.log", free_port())
                client_log = logs / f"{name}-{number}-client.log"
                with console.status(f"round {number}: {name} ({workload.tasks} rollouts)"):
                    figures = await one_round(store, workload, client_log)
                rounds.append({"round": number, "store": name, **figures})
                console.print(f"round {number}: {name}, {figures['rollouts_per_s']} rollouts/s")
    medians = summary(rounds)
    return {
        "workload": {**asdict(workload), "rounds": args.rounds},
        "stores": medians,
        "rollouts_per_s_ratio": round(
            medians["agl-stream"]["rollouts_per_s"] / medians["agl"]["rollouts_per_s"], 3
        ),
        "rounds": rounds,
    }


def report(figures: dict[str, Any]) -> None:
    medians = figures["stores"]
    table = Table(
        title=f"Agent Lightning's store benchmark client ({figures['workload']['tasks']} "
        f"rollouts; median of {figures['workload']['rounds']} rounds)",
        title_justify="left",
    )
    table.add_column("figure")
    for store in STORES:
        table.add_column(store, justify="right")
    for key, label in (
        ("wall_s", "fit wall s"),
        ("rollouts_per_s", "rollouts/s"),
        ("store_cpu_ms_per_rollout", "store side CPU ms / rollout"),
        ("client_cpu_ms_per_rollout", "client side CPU ms / rollout"),
    ):
        table.add_row(label, *(str(medians[store][key]) for store in STORES))
    table.add_row("rollouts/s, agl-stream / agl", "", str(figures["rollouts_per_s_ratio"]))
    console = Console()
    console.print(table)
    rounds = Table(title="each round", title_justify="left")
    columns = ("round", "store", "start s", "wall s", "rollouts/s", "store CPU s", "client CPU s")
    for column in columns:
        rounds.add_column(column, justify="left" if column == "store" else "right")
    for r in figures["rounds"]:
        parts = ", ".join(f"{role} {s}" for role, s in r["store_cpu_s"].items())
        rounds.add_row(str(r["round"]), r["store"], str(r["store_start_s"]), str(r["wall_s"]),
                       str(r["rollouts_per_s"]), parts, str(r["client_cpu_s"]))  # fmt: skip
    console.print(rounds)


def _workload(args: argparse.Namespace) -> Workload:
    return Workload(
        tasks=args.tasks, batch_size=args.batch_size, runners=args.runners,
        max_rounds=args.max_rounds, sleep_seconds=args.sleep_seconds,
        poll_seconds=args.poll_seconds, seed=args.seed,
    )  # fmt: skip


def command_line() -> argparse.ArgumentParser:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each store, alternated")
    parser.add_argument("--tasks", type=int, default=512, help="rollouts per round")
    parser.add_argument("--batch-size", type=int, default=128, help="rollouts per batch")
    parser.add_argument("--runners", type=int, default=4, help="the Trainer's runner processes")
    parser.add_argument("--max-rounds", type=int, default=5, help="most rounds of one rollout")
    parser.add_argument("--sleep-seconds", type=float, default=0.01,
                        help="most seconds a span sleeps (the original's default: 1)")  # fmt: skip
    parser.add_argument("--poll-seconds", type=float, default=0.2,
                        help="the algorithm's wait between polls (the original's: 5)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="every task's draws come from it")
    parser.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)  # the client's run
    return parser


if __name__ == "__main__":
    arguments = command_line()
    if "--client" in sys.argv:
        given = arguments.parse_args()
        _client(given.client, _workload(given))
    else:
        run_benchmark(arguments, main, report)
