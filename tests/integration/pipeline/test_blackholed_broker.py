"""Takeovers with a broker blackholed: a 3-broker Apache Kafka cluster on three hosts (network
namespaces on one bridge), one of them cut off (iptables drops every packet of its link:
connections hang, nothing is refused) and fenced by the cluster; two runners in this process
bootstrap from all three brokers.

A runner works the rollouts, a second one joins (every partition is settled again by its new
owner), then it leaves with attempts in flight (the first takes its partitions over, fencing
its lanes, and runs that work again). Every settle takes well under a request timeout:
before, each client a takeover started bootstrapped from the brokers in a random order and
waited a request timeout whenever the cut one came first (five clients a settle: a
timeout or more in six takeovers out of seven). From the topics afterwards: every rollout
succeeded once, and what moved ran again on the runner that stayed.

Needs root (network namespaces, iptables); skipped with the reason otherwise. Size:
--multi-host-size ci (default) or long.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agl_stream.bus.topic_admin import apply_topics
from agl_stream.embedded import kafka_node
from agl_stream.events import AttemptStatus
from agl_stream.runner.worker import Runner
from agl_stream.runtime.config import KafkaSettings, load
from tests.support.helpers import eventually
from tests.support.netns import fenced, kafka_cluster, network, unavailable
from tests.support.runs import queue, runner_in_process, wait_terminal

WHY_NOT = unavailable()
pytestmark = [
    pytest.mark.multihost,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(WHY_NOT is not None, reason=f"blackholed broker test: {WHY_NOT}"),
]

BROKERS = ("kafka-1", "kafka-2", "kafka-3")
REQUEST_TIMEOUT_MS = 10_000
# The controller fences a broker it has not heard from in 3 s, not 9 (the test's time).
FAST_FENCING = {"broker.session.timeout.ms": 3000, "broker.heartbeat.interval.ms": 500}


@dataclass(frozen=True)
class Size:
    rollouts: int
    sleep: float  # each attempt's: longer than the runner's hand-back grace (2 s)


SIZES = {"ci": Size(rollouts=16, sleep=4.0), "long": Size(rollouts=200, sleep=4.0)}


@pytest.fixture
def private_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="agl-blackhole-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def settled(*runners: Runner, partitions: int) -> bool:
    lanes = [len(r.lanes) for r in runners]
    return all(lanes) and sum(lanes) == partitions


async def _busy(runner: Runner) -> bool:
    return len(runner.in_flight) >= 2


async def _settled(runner: Runner, partitions: int) -> bool:
    return settled(runner, partitions=partitions)


async def _both_settled_and_busy(stayer: Runner, leaver: Runner, partitions: int) -> bool:
    return settled(stayer, leaver, partitions=partitions) and len(leaver.in_flight) >= 2


async def test_takeovers_with_a_blackholed_broker_wait_no_request_timeout(
    private_tmp: Path, request: pytest.FixtureRequest
) -> None:
    size = SIZES[str(request.config.getoption("--multi-host-size"))]
    with network(BROKERS) as net:
        async with kafka_cluster(net, private_tmp, BROKERS, FAST_FENCING) as nodes:
            kafka = load(
                KafkaSettings,
                bootstrap_servers=",".join(f"{n.host}:{n.port}" for n in nodes),
                topic_prefix=f"bh{uuid.uuid4().hex[:6]}.",
                replication_factor=3,
                request_timeout_ms=REQUEST_TIMEOUT_MS,
            )
            await apply_topics(kafka)
            partitions = 8
            # A broker that is not the active controller: the cluster fences it within its
            # session timeout, with no election first.
            controller = kafka_node.active_controller(nodes, private_tmp)
            cut = [n for n in nodes if n.node_id != controller][-1]
            net.cut_off(BROKERS[cut.node_id - 1])
            others = ",".join(f"{n.host}:{n.port}" for n in nodes if n != cut)
            await fenced(kafka.model_copy(update={"bootstrap_servers": others}), cut.node_id, 60)

            ids = await queue(kafka, [{"sleep": size.sleep}] * size.rollouts)
            async with runner_in_process(kafka, worker_id="stayer", concurrency=4) as stayer:
                await eventually(lambda: _busy(stayer), 60, "the stayer to run rollouts")
                # It leaves at once: what it runs then is handed back, not finished.
                leaving = {"worker_id": "leaver", "concurrency": 4, "shutdown_grace_seconds": 0}
                async with runner_in_process(kafka, **leaving) as leaver:
                    await eventually(
                        lambda: _both_settled_and_busy(stayer, leaver, partitions),
                        60,
                        "the group to split the partitions, and the leaver to run some",
                    )
                # The leaver handed its partitions back with attempts in flight.
                await eventually(
                    lambda: _settled(stayer, partitions), 60, "the stayer to take every partition"
                )
                h = await wait_terminal(kafka, ids, 60 + size.rollouts * size.sleep)
            takeovers = list(stayer.takeovers) + list(leaver.takeovers)
    problems: dict[str, list[object]] = {"not succeeded": [], "two successes": []}
    for rollout_id in ids:
        final = h.final(rollout_id)
        succeeded = [f for f in h.finished[rollout_id] if f.status == AttemptStatus.SUCCEEDED]
        if final is None or final.status != "succeeded":
            problems["not succeeded"].append(rollout_id)
        if len(succeeded) != 1 or len(h.ended[rollout_id]) != 1:
            problems["two successes"].append((rollout_id, [f.worker_id for f in succeeded]))
    moved = [
        r
        for r in ids
        if any(s.worker_id == "leaver" for s in h.started[r])
        and [f.worker_id for f in h.finished[r] if f.status == AttemptStatus.SUCCEEDED]
        == ["stayer"]
    ]
    slow = [(t.tp.partition, round(t.seconds, 1)) for t in takeovers if t.seconds > 5.0]
    print(
        f"a broker blackholed ({request.config.getoption('--multi-host-size')}): "
        f"{len(ids)} rollouts, {len(moved)} moved off the leaver; {len(takeovers)} takeovers, "
        f"the slowest {max(t.seconds for t in takeovers):.2f} s"
    )
    assert not any(problems.values()), problems
    assert moved, "no attempt was in flight on the leaver when it left: the test proved little"
    assert len(takeovers) >= 2 * partitions  # the split, and the stayer taking all back
    assert slow == [], f"takeovers that waited on the cut broker: {slow}"
