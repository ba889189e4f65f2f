"""Takeovers with a broker blackholed: how long a runner takes to settle a tasks partition
(fence the previous writer, read the checkpoint, fold the co-partitioned rollouts partition)
on a 3-broker cluster with one broker's network dropping every packet, against the same
cluster with every broker healthy, side by side in one run.

    .venv/bin/python -m benchmarks.takeover_blackhole   # as root: make takeover-blackhole

Three Apache Kafka nodes, each on a host of its own (a network namespace on one bridge,
tests/support/netns.py), topics replicated three times with two in sync; the runners run in
this process, on the driver host, and bootstrap from all three brokers. Each round: some
rollouts are queued and run by a resident runner, a second runner joins (the group splits
the 8 tasks partitions: every partition is settled again by its owner), then it stops (the
resident takes all 8 over). Every partition settled in a round is one takeover, timed by
the runner that settled it (`Takeover.seconds`). After a warm-up round, `--rounds` rounds
with every broker healthy; then one broker host is cut off (iptables DROP on its link, as
when a switch port or a host's network dies: connections hang, nothing is refused) and,
once the cluster has fenced that broker (leaders, coordinators and the metadata moved to the
others), the resident runs one more round (its clients began before the cut: "through the
cut"), and a fresh resident on fresh topics runs `--rounds` rounds. Needs root (network
namespaces, iptables).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition
from rich.console import Console
from rich.table import Table

from agl_stream.agent import rollout
from agl_stream.bus.streams import Topics, read_partitions
from agl_stream.bus.topic_admin import apply_topics
from agl_stream.commands.enqueue import RolloutOptions, enqueue
from agl_stream.events import RolloutFinished
from agl_stream.runner.worker import Runner, RunnerConfig, Takeover
from agl_stream.runtime.config import KafkaSettings, load
from benchmarks.stack import benchmark_parser, run_benchmark
from tests.support.netns import Network, fenced, kafka_cluster, network, unavailable

console = Console()
BROKERS = ("kafka-1", "kafka-2", "kafka-3")
CUT = "kafka-3"  # node 3


@rollout
async def quick(task: dict[str, Any]) -> float:
    return 1.0


class Resident:
    """A runner running in this process until closed."""

    def __init__(self, kafka: KafkaSettings, name: str) -> None:
        config = RunnerConfig(
            agent=quick, worker_id=name, session_timeout_ms=6000, heartbeat_seconds=1.0,
            shutdown_grace_seconds=5.0, gateway=False,
        )  # fmt: skip
        self.runner = Runner(kafka, config)
        self.stop = asyncio.Event()
        self.job = asyncio.create_task(self.runner.run(self.stop))

    def check(self) -> None:
        if self.job.done():
            self.job.result()  # raises what stopped it
            raise RuntimeError(f"{self.runner.config.worker_id} stopped by itself")

    async def close(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.job, 120)


@asynccontextmanager
async def running(kafka: KafkaSettings, name: str) -> AsyncIterator[Resident]:
    member = Resident(kafka, name)
    try:
        yield member
    finally:
        await member.close()


async def until(
    check: Callable[[], Awaitable[bool]], within: float, what: str,
    members: Sequence[Resident], every: float = 0.05,
) -> None:  # fmt: skip
    deadline = time.monotonic() + within
    while not await check():
        for member in members:
            member.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {within:.0f} s for {what}")
        await asyncio.sleep(every)


async def settled(members: Sequence[Resident], partitions: int, within: float) -> None:
    """Until the members hold a lane for every tasks partition between them, each some."""

    async def done() -> bool:
        lanes = [len(m.runner.lanes) for m in members]
        return all(lanes) and sum(lanes) == partitions

    await until(done, within, "every partition settled", members)


async def ended(healthy: KafkaSettings, ids: list[str], members: Sequence[Resident]) -> None:
    wanted = set(ids)
    rollouts = partitions_of(healthy, "rollouts")

    async def done() -> bool:
        events = await read_partitions(healthy, rollouts)
        return wanted <= {e.rollout_id for e in events if isinstance(e, RolloutFinished)}

    await until(done, 300, f"{len(ids)} rollouts to end", members, every=0.5)


def partitions_of(kafka: KafkaSettings, short: str) -> list[TopicPartition]:
    topics = Topics(kafka)
    return [TopicPartition(topics.name(short), p) for p in range(topics.specs[short].partitions)]


@dataclass(frozen=True)
class Workload:
    kafka: KafkaSettings  # what the runners use: every broker
    healthy: KafkaSettings  # what this driver uses: the brokers not cut
    rollouts: int  # queued each round
    within: float  # the longest wait for a rebalance

    @property
    def partitions(self) -> int:
        return len(partitions_of(self.kafka, "tasks"))


async def one_round(resident: Resident, work: Workload, name: str) -> list[Takeover]:
    """Rollouts run by the resident runner; another one joins, then stops. Every partition
    settled meanwhile (by either), each a takeover."""
    ids = await enqueue(work.healthy, [{} for _ in range(work.rollouts)], RolloutOptions())
    await ended(work.healthy, ids, [resident])
    before = len(resident.runner.takeovers)
    async with running(work.kafka, name) as joiner:
        await settled([resident, joiner], work.partitions, work.within)
    await settled([resident], work.partitions, work.within)
    taken = list(joiner.runner.takeovers) + list(resident.runner.takeovers)[before:]
    console.print(f"  {name}: " + ", ".join(f"{t.seconds:.2f}" for t in taken) + " s")
    return taken


async def rounds(resident: Resident, work: Workload, count: int, tag: str) -> list[Takeover]:
    return [t for i in range(count) for t in await one_round(resident, work, f"{tag}-{i + 1}")]


def spread(seconds: list[float]) -> dict[str, float]:
    return {
        "min_s": round(min(seconds), 3),
        "median_s": round(statistics.median(seconds), 3),
        "max_s": round(max(seconds), 3),
    }


async def measure(net: Network, args: argparse.Namespace, home: Path) -> dict[str, Any]:
    async with kafka_cluster(net, home, BROKERS) as nodes:
        every = ",".join(f"{n.host}:{n.port}" for n in nodes)
        cut_node = BROKERS.index(CUT) + 1
        others = ",".join(f"{n.host}:{n.port}" for n in nodes if n.node_id != cut_node)

        def workload(prefix: str) -> Workload:
            def settings(servers: str) -> KafkaSettings:
                return load(
                    KafkaSettings, bootstrap_servers=servers, topic_prefix=prefix,
                    replication_factor=3, request_timeout_ms=args.request_timeout_ms,
                )  # fmt: skip

            return Workload(settings(every), settings(others), args.rollouts, args.settle_within)

        clean_work, cut_work = (workload(f"bh{uuid.uuid4().hex[:6]}.") for _ in range(2))
        # Both sets of topics now: replicated three times, they cannot be created with a
        # broker out.
        await apply_topics(clean_work.kafka)
        await apply_topics(cut_work.kafka)
        console.print("every broker healthy:")
        async with running(clean_work.kafka, "resident") as resident:
            await settled([resident], clean_work.partitions, clean_work.within)
            await one_round(resident, clean_work, "warm-up (not counted)")
            clean = await rounds(resident, clean_work, args.rounds, "clean")
            # The resident runs on through the cut: its clients began before it, and their
            # metadata names the cut broker until they learn otherwise. Its takeovers from the
            # cut on count, those while the cluster had not fenced the broker yet too (the cut
            # can move the group's coordinator, which rebalances it).
            before = len(resident.runner.takeovers)
            net.cut_off(CUT)
            console.print(f"{CUT} blackholed; waiting until the cluster fences it")
            fence_s = await fenced(cut_work.healthy, cut_node, 120)
            console.print(f"{CUT} blackholed and fenced ({fence_s:.1f} s):")
            await settled([resident], clean_work.partitions, clean_work.within)
            while_fencing = list(resident.runner.takeovers)[before:]
            through = while_fencing + await one_round(resident, clean_work, "through the cut")
        async with running(cut_work.kafka, "resident-2") as resident:
            await settled([resident], cut_work.partitions, cut_work.within)
            cut = await rounds(resident, cut_work, args.rounds, "blackholed")
        net.reconnect(CUT)
    clean_s, cut_s = [t.seconds for t in clean], [t.seconds for t in cut]
    return {
        "brokers": len(BROKERS),
        "request_timeout_ms": args.request_timeout_ms,
        "rounds": args.rounds,
        "takeovers_each": len(clean_s),
        "clean": spread(clean_s),
        "blackholed": spread(cut_s),
        "median_ratio": round(statistics.median(cut_s) / statistics.median(clean_s), 2),
        "max_ratio": round(max(cut_s) / max(clean_s), 2),
        "fenced_after_s": round(fence_s, 1),
        "through_the_cut": spread([t.seconds for t in through]),
        "through_the_cut_while_fencing": len(while_fencing),
        "clean_seconds": [round(s, 3) for s in clean_s],
        "blackholed_seconds": [round(s, 3) for s in cut_s],
        "through_the_cut_seconds": [round(t.seconds, 3) for t in through],
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    why_not = unavailable()
    if why_not is not None:
        raise SystemExit(f"takeover_blackhole {why_not}")
    home = Path(tempfile.mkdtemp(prefix="agl-bench-blackhole-"))
    try:
        with network(BROKERS) as net:
            return await measure(net, args, home)
    finally:
        shutil.rmtree(home, ignore_errors=True)


ROWS = (
    ("clean", "all healthy"),
    ("blackholed", f"{CUT} blackholed"),
    ("through_the_cut", f"{CUT} blackholed, a runner up since before"),
)


def report(result: dict[str, Any]) -> None:
    table = Table(
        title=f"takeover of one tasks partition, {result['brokers']} brokers "
        f"({result['takeovers_each']} takeovers each)",
        title_justify="left",
    )
    for column in ("brokers", "min s", "median s", "max s"):
        table.add_column(column)
    for key, label in ROWS:
        row = result[key]
        table.add_row(label, str(row["min_s"]), str(row["median_s"]), str(row["max_s"]))
    console.print(table)
    console.print(
        f"blackholed / clean: {result['median_ratio']}x (medians), "
        f"{result['max_ratio']}x (maxima); target <= 2.0"
    )


if __name__ == "__main__":
    parser = benchmark_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=4, help="a runner joins and leaves")
    parser.add_argument("--rollouts", type=int, default=16, help="queued each round")
    parser.add_argument(
        "--request-timeout-ms", type=int, default=10_000, help="the clients' request timeout"
    )
    parser.add_argument(
        "--settle-within", type=float, default=600, help="the longest wait for a rebalance"
    )
    run_benchmark(parser, main, report)
