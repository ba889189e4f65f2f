"""Queueing tasks from Java against queueing them from Python, side by side into the runners.

    .venv/bin/python -m benchmarks.java_enqueue --tasks 10000 --rounds 2 --runners 2

On a private embedded stack, runner processes (the synthetic agent, `--max-rounds` rounds a
rollout) work one set of topics throughout. Each round queues the same N task inputs with each
producer in turn, waiting until the runners have finished every rollout before the next:

- `java`: the Java example (examples/java-client: Apache Kafka's kafka-clients 4.1.1,
  Apache Avro 1.12.1, no agl-stream code) as a process, `agl-stream-java-client enqueue
  --file TASKS.jsonl` (its launcher: `java -jar` with the quick compiler alone and the serial
  collector); its own figure (read and check the file, start the producer, send, every
  record acknowledged) and the process's wall time with the JVM's start;
- `python`: `agl_stream.commands.enqueue.enqueue()` in this process (the producer's start,
  chunks of 500, every record acknowledged);
- `python-cli`: `agl-stream enqueue TASKS.jsonl --again` as a process (the CLI's keyed
  enqueue: transactions of 500, resumable), its wall time with Python's start.

Tasks/s is N over the enqueue's seconds; "to the runners' last finish" runs from the enqueue's
start to the last RolloutFinished of those rollouts. The rounds alternate the producers'
order; the figures are the medians over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import resource
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from agl_stream.commands.enqueue import RolloutOptions, enqueue
from agl_stream.runtime.config import KafkaSettings, child_environment
from benchmarks.runners import Monitor, positions
from benchmarks.stack import benchmark_parser, fresh_topics, private_stack, run_benchmark
from tests.support.clients import CLIENTS, SCHEMAS, Built

console = Console()
PRODUCERS = ("java", "python", "python-cli")
QUEUED = re.compile(r"queued (\d+) rollouts in ([0-9.]+) s")


def children_cpu() -> float:
    """CPU seconds of this process's children that have ended (the runners have not)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def run_process(
    argv: list[str], env: dict[str, str] | None = None
) -> tuple[str, float, float]:
    """A producer process: its standard error, wall seconds and CPU seconds."""
    cpu = children_cpu()
    began = time.perf_counter()
    process = await asyncio.create_subprocess_exec(
        *argv, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, err = await process.communicate()
    wall = time.perf_counter() - began
    if process.returncode != 0:
        raise SystemExit(f"{argv[:4]} exited {process.returncode}:\n{err.decode()[-3000:]}")
    return err.decode(), wall, children_cpu() - cpu


async def queue_with(
    producer: str, kafka: KafkaSettings, java: Built, tasks: list[Any], file: Path
) -> dict[str, float]:
    """Queue the tasks with one producer: its enqueue seconds, process wall and CPU seconds."""
    if producer == "java":
        argv = [*java.argv, "enqueue", "--file", str(file), "--schemas", str(SCHEMAS),
                "--bootstrap-servers", kafka.bootstrap_servers,
                "--topic-prefix", kafka.topic_prefix]  # fmt: skip
        said, wall, cpu = await run_process(argv)
        found = QUEUED.search(said)
        if found is None or int(found[1]) != len(tasks):
            raise SystemExit(f"the Java client said: {said[-2000:]}")
        return {"enqueue_s": float(found[2]), "process_wall_s": wall, "process_cpu_s": cpu}
    if producer == "python":
        cpu, began = time.process_time(), time.perf_counter()
        await enqueue(kafka, tasks, RolloutOptions())
        seconds = time.perf_counter() - began
        return {"enqueue_s": seconds, "process_cpu_s": time.process_time() - cpu}
    argv = [sys.executable, "-m", "agl_stream.cli.main", "enqueue", str(file), "--again"]
    _, wall, cpu = await run_process(argv, child_environment(kafka))
    return {"enqueue_s": wall, "process_wall_s": wall, "process_cpu_s": cpu}


async def phase(
    producer: str, kafka: KafkaSettings, java: Built, tasks: list[Any], file: Path, pids: list[int]
) -> dict[str, Any]:
    start = await positions(kafka, "rollouts")
    began = time.time()
    figures = await queue_with(producer, kafka, java, tasks, file)
    monitor = Monitor()  # after the enqueue, so that this process's CPU is the enqueue's own
    await asyncio.wait_for(monitor.follow(kafka, start, len(tasks), pids), 600)
    last = max(monitor.finished.values()) / 1000
    figures["to_last_finished_s"] = last - began
    figures["tasks_per_s"] = len(tasks) / figures["enqueue_s"]
    return {"producer": producer, **{k: round(v, 3) for k, v in figures.items()}}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="agl-java-enqueue-") as tmp, private_stack() as state:
        java = CLIENTS["java"].build(Path(tmp))
        _, kafka = await fresh_topics(f"bench-java-{uuid.uuid4().hex[:6]}", state)
        tasks = [{"seed": i, "max_rounds": args.max_rounds} for i in range(args.tasks)]
        file = Path(tmp) / "tasks.jsonl"
        file.write_text("".join(json.dumps(t) + "\n" for t in tasks))
        runners = [
            await asyncio.create_subprocess_exec(
                sys.executable, "-m", "agl_stream.cli.main", "worker", "runner",
                "--agent", "benchmarks.synthetic:agent", "--concurrency", str(args.concurrency),
                "--worker-id", f"bench-{i}", env=child_environment(kafka),
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )
            for i in range(args.runners)
        ]  # fmt: skip
        pids = [r.pid for r in runners]
        try:
            warm = [{"seed": i, "max_rounds": 1} for i in range(25 * args.runners)]
            await phase("python", kafka, java, warm, file, pids)  # the runners join the group
            rounds = []
            for number in range(args.rounds):
                order = PRODUCERS if number % 2 == 0 else tuple(reversed(PRODUCERS))
                for producer in order:
                    result = await phase(producer, kafka, java, tasks, file, pids)
                    rounds.append({"round": number + 1, **result})
        finally:
            for runner in runners:
                runner.terminate()
            await asyncio.gather(*(r.wait() for r in runners))
    medians = {
        producer: {
            key: round(statistics.median(r[key] for r in rounds if r["producer"] == producer), 3)
            for key in ("enqueue_s", "tasks_per_s", "process_wall_s", "process_cpu_s",
                        "to_last_finished_s")
            if all(key in r for r in rounds if r["producer"] == producer)
        }
        for producer in PRODUCERS
    }  # fmt: skip
    return {
        "tasks": args.tasks, "rounds": args.rounds, "runners": args.runners,
        "concurrency": args.concurrency, "max_rounds": args.max_rounds,
        "java_build_s": round(java.build_seconds, 1),
        "producers": medians,
        "java_to_python_tasks_per_s": round(
            medians["java"]["tasks_per_s"] / medians["python"]["tasks_per_s"], 2
        ),
        "java_process_to_python_cli_wall": round(
            medians["java"]["process_wall_s"] / medians["python-cli"]["process_wall_s"], 2
        ),
        "each_round": rounds,
    }  # fmt: skip


def report(figures: dict[str, Any]) -> None:
    table = Table(title="enqueue: Java against Python", title_justify="left")
    columns = ("enqueue_s", "tasks_per_s", "process_wall_s", "process_cpu_s", "to_last_finished_s")
    table.add_column("producer")
    for column in columns:
        table.add_column(column, justify="right")
    for producer, values in figures["producers"].items():
        table.add_row(producer, *(str(values.get(c, "")) for c in columns))
    console.print(table)
    console.print(
        f"Java / Python tasks/s: {figures['java_to_python_tasks_per_s']}; Java process / "
        f"Python CLI process wall: {figures['java_process_to_python_cli_wall']}"
    )


if __name__ == "__main__":
    parser = benchmark_parser(__doc__)
    parser.add_argument("--tasks", type=int, default=10_000, help="tasks each producer queues")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runners", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32, help="rollouts at once per runner")
    parser.add_argument("--max-rounds", type=int, default=1, help="the synthetic agent's rounds")
    run_benchmark(parser, main, report)
