"""Several hosts on one machine, each a network namespace on one bridge: a 3-broker Apache
Kafka cluster (replication 3, two in sync) on three hosts, a runner on each of two more, the
projector and the trainer on a sixth; PostgreSQL and this test on the "driver" host.

1. A runner host is cut off mid-run (iptables drops every packet of its link): its
   partitions move to the other runner, which runs again what was in flight there; nothing
   is lost. The host comes back while its writes of that work are still pending: Kafka
   fences them (the new owner's lane bumped the partition's producer epoch), so no rollout
   gets a second success, and the runner rejoins the group.
2. A broker host is cut off mid-run: the cluster carries on (leaders move; writes need two of
   three replicas); every rollout ends.

Afterwards, from the topics and the read model: every rollout succeeded once, every finished
attempt has all its spans, the trainer consumed each offset range once. Needs root (network
namespaces, iptables); skipped with the reason otherwise. Size: --multi-host-size ci
(default) or long (`make multi-host`).
"""

from __future__ import annotations

import asyncio
import random
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from agl_stream.bus.streams import read_partitions
from agl_stream.bus.topic_admin import apply_topics
from agl_stream.db.migrate import migrate
from agl_stream.embedded import postgres
from agl_stream.embedded.process import pick_port
from agl_stream.events import AttemptStatus, WorkerHeartbeat
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings, load
from agl_stream.training.checkpoints import CheckpointStore, lineage_problems
from tests.integration.training.test_trainer import published
from tests.support.chaos import RUN, Crew, Member
from tests.support.helpers import eventually, traversable
from tests.support.netns import Network, kafka_cluster, network, unavailable
from tests.support.projection import caught_up, dump, ends
from tests.support.runs import History, history, queue

WHY_NOT = unavailable()
pytestmark = [
    pytest.mark.multihost,
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(WHY_NOT is not None, reason=f"multi-host test: {WHY_NOT}"),
]

BROKERS = ("kafka-1", "kafka-2", "kafka-3")
RUNNERS = ("runner-1", "runner-2")
WORKERS = "workers"  # the projector's and the trainer's host


@dataclass(frozen=True)
class Size:
    rollouts: int  # per phase
    sleep: float  # each attempt's
    runner_cuts: int  # runner hosts cut, in turn
    broker_cuts: int  # broker hosts cut, in turn
    # The share of a phase's rollouts that must end while a broker host is cut off (the
    # rest may end after it is back): a third in CI, where time is short, all at the long
    # setting.
    end_while_broker_cut: float


SIZES = {
    "ci": Size(rollouts=32, sleep=3.0, runner_cuts=1, broker_cuts=1, end_while_broker_cut=1 / 3),
    "long": Size(rollouts=400, sleep=4.0, runner_cuts=4, broker_cuts=3, end_while_broker_cut=1.0),
}


class HostCrew(Crew):
    """The chaos test's workers, each started on its host."""

    def __init__(
        self, net: Network, placement: dict[str, str], kafka: KafkaSettings,
        database: DatabaseSettings, logs: Path, checkpoints: Path,
    ) -> None:  # fmt: skip
        super().__init__(kafka, database, logs, checkpoints)
        self.net, self.placement = net, placement

    async def start(self, role: str, name: str) -> None:
        log = self.logs / f"{name}.log"
        with log.open("ab") as out:
            process = await asyncio.create_subprocess_exec(
                *self.net.prefix(self.placement[name]), sys.executable, "-m",
                "agl_stream.cli.main", "worker", role, *self._args(role, name),
                env=self.env, stdout=out, stderr=out,
            )  # fmt: skip
        self.members[name] = Member(role, name, process, log)

    def died_by_themselves(self) -> list[str]:
        return [
            f"{m.name}: {m.log.read_text(errors='replace')[-1500:]}"
            for m in self.members.values()
            if m.process.returncode is not None
        ]


@asynccontextmanager
async def database_on_driver(net: Network, home: Path) -> AsyncIterator[DatabaseSettings]:
    port = pick_port(34_000, 35_000)
    await asyncio.to_thread(postgres.start, home, port, net.driver, f"{net.subnet}.0/24")
    try:
        url = f"postgresql://{postgres.SUPERUSER}@{net.driver}:{port}/agl_stream"
        database = load(DatabaseSettings, database_url=url)
        await migrate(database)
        yield database
    finally:
        await asyncio.to_thread(postgres.stop, home)


async def all_ended(
    kafka: KafkaSettings, ids: list[str], within: float, share: float = 1.0
) -> None:
    """Until `share` of the rollouts of `ids` have ended. The driver's own reads may time out
    while a broker is cut off and its partitions' leaders move: that read is tried again."""
    wanted = max(1, round(len(ids) * share))

    async def ended() -> bool:
        try:
            h = await history(kafka, with_spans=False)
        except KafkaError:
            return False
        return sum(1 for r in ids if r in h.ended) >= wanted

    await eventually(ended, within, f"{wanted} of {len(ids)} rollouts to end")


async def heartbeats(kafka: KafkaSettings, worker_id: str) -> list[WorkerHeartbeat]:
    events = await read_partitions(kafka, [TopicPartition(kafka.topic("workers"), 0)])
    return [e for e in events if isinstance(e, WorkerHeartbeat) and e.worker_id == worker_id]


def in_flight_on(h: History, worker_id: str) -> dict[str, str]:
    """Rollouts whose latest attempt started on the worker and has not finished: rollout id
    -> that attempt's id."""
    out = {}
    for rollout_id, started in h.started.items():
        finished = {f.attempt_id for f in h.finished.get(rollout_id, [])}
        latest = started[-1]
        if latest.worker_id == worker_id and latest.attempt_id not in finished:
            out[rollout_id] = latest.attempt_id
    return out


async def counts(kafka: KafkaSettings, worker_id: str) -> tuple[int, dict[str, int]]:
    beats = await heartbeats(kafka, worker_id)
    return len(beats), (beats[-1].counts if beats else {})


async def cut_a_runner(
    net: Network, kafka: KafkaSettings, host: str, ids: list[str], notes: Counter[str]
) -> dict[str, str]:
    """Cut the runner's host while it runs some of `ids`; once the other runner has started
    again each of those it had not finished (it took their partitions over, fencing their
    producers), bring it back: what it finished meanwhile is still on its way to the brokers
    and is refused. Returns what was in flight on it at the cut: rollout id -> attempt id."""
    other = next(r for r in RUNNERS if r != host)
    seen: dict[str, str] = {}

    async def busy() -> bool:
        running = in_flight_on(await history(kafka, with_spans=False), host)
        seen.clear()
        seen.update({r: a for r, a in running.items() if r in ids})
        return len(seen) >= 2

    await eventually(busy, 120, f"{host} to run some rollouts")
    beats_before = (await counts(kafka, host))[0]
    net.cut_off(host)
    cut_at = time.monotonic()

    async def moved_over() -> bool:
        h = await history(kafka, with_spans=False)
        return all(
            r in h.ended or any(s.worker_id == other for s in h.started.get(r, [])) for r in seen
        )

    await eventually(moved_over, 120, f"{other} to take over what {host} was running")
    notes["seconds from a runner's cut until its work runs elsewhere"] += round(
        time.monotonic() - cut_at
    )
    net.reconnect(host)
    healed = (await counts(kafka, host))[0]

    async def back() -> bool:
        return (await counts(kafka, host))[0] >= max(healed, beats_before) + 2

    # Its writes of the moved work reach the brokers and are refused (its partitions'
    # producers were fenced by the takeover), or time out: either way they are not on the
    # topics (read committed), which the end of the test checks. It heartbeats again.
    await eventually(back, 120, f"{host} to heartbeat again")
    await all_ended(kafka, ids, 180)
    notes["runner cuts"] += 1
    return seen


async def cut_a_broker(
    net: Network, kafka: KafkaSettings, host: str, ids: list[str], notes: Counter[str],
    share: float,
) -> None:  # fmt: skip
    async def started() -> bool:
        h = await history(kafka, with_spans=False)
        return sum(1 for r in ids if r in h.started) >= 4

    await eventually(started, 120, "rollouts to start before the broker's cut")
    net.cut_off(host)
    cut_at = time.monotonic()
    try:
        await all_ended(kafka, ids, 600, share)
    finally:
        net.reconnect(host)
    notes[f"seconds until {share:.0%} of a phase's rollouts ended, a broker cut"] += round(
        time.monotonic() - cut_at
    )
    await all_ended(kafka, ids, 300)
    notes["broker cuts"] += 1


@pytest.fixture
def private_tmp() -> Iterator[Path]:
    """A directory of this test's own, outside pytest's: other pytest sessions on the machine
    tidy pytest's directories, and PostgreSQL's data must not move under it."""
    path = Path(tempfile.mkdtemp(prefix="agl-multi-host-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def test_runner_and_broker_hosts_cut_off(
    private_tmp: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = SIZES[str(request.config.getoption("--multi-host-size"))]
    rng = random.Random(24)
    notes: Counter[str] = Counter()
    tmp_path = private_tmp
    home = traversable(tmp_path / "hosts")
    # A cut-off broker answers nothing: a client's request to it (a connection's setup too)
    # fails after this long, then goes elsewhere (aiokafka uses the request timeout for
    # both; Kafka's Java client gives a connection's setup 10 s). A cut runner's transaction
    # requests are retried past it, so they still reach the brokers when it is back.
    monkeypatch.setenv("AGL_STREAM_REQUEST_TIMEOUT_MS", "10000")
    hosts = (*BROKERS, *RUNNERS, WORKERS)
    with network(hosts) as net:
        async with (
            kafka_cluster(net, home, BROKERS) as nodes,
            database_on_driver(net, home) as database,
        ):
            kafka = load(
                KafkaSettings,
                request_timeout_ms=10_000,
                bootstrap_servers=",".join(f"{n.host}:{n.port}" for n in nodes),
                topic_prefix=f"mh{uuid.uuid4().hex[:6]}.", replication_factor=3,
            )  # fmt: skip
            await apply_topics(kafka)
            store = CheckpointStore(str(tmp_path / "checkpoints"))
            placement = {"trainer": WORKERS, "projector": WORKERS, **{r: r for r in RUNNERS}}
            crew = HostCrew(
                net, placement, kafka=kafka, database=database, logs=tmp_path / "logs",
                checkpoints=store.root,
            )  # fmt: skip
            try:
                await crew.start("trainer", "trainer")

                async def first_version() -> bool:
                    return any(e.resources_id == f"{RUN}-v0" for e in await published(kafka))

                await eventually(first_version, 180, "the trainer to publish its first version")
                await crew.start("projector", "projector")
                for runner in RUNNERS:
                    await crew.start("runner", runner)
                every: list[str] = []
                in_flight: dict[str, str] = {}  # rollout id -> its attempt on a cut runner

                def tasks() -> list[dict[str, object]]:
                    return [
                        {"letter": rng.choice("abcde"), "sleep": size.sleep}
                        for _ in range(size.rollouts)
                    ]

                for i in range(size.runner_cuts):
                    ids = await queue(kafka, tasks())
                    every += ids
                    cut = RUNNERS[i % 2]
                    in_flight |= await cut_a_runner(net, kafka, cut, ids, notes)
                for i in range(size.broker_cuts):
                    ids = await queue(kafka, tasks())
                    every += ids
                    await cut_a_broker(
                        net, kafka, BROKERS[(i + 1) % 3], ids, notes, size.end_while_broker_cut
                    )
                died = crew.died_by_themselves()
                await crew.stop("runner")
                await crew.stop("trainer")
                final = await ends(kafka)
                await eventually(
                    lambda: caught_up(database, final), 180, "the projector to catch up"
                )
                await crew.stop("projector")
            finally:
                await crew.stop_all()
            h = await history(kafka)
            live = await dump(database)
    # What moved: in flight on a cut runner, started again by another.
    moved = {
        r: attempt
        for r, attempt in in_flight.items()
        if any(s.attempt_id != attempt for s in h.started.get(r, []))
    }

    # Nothing lost, nothing doubled, from the topics (read committed) and the read model.
    problems: dict[str, list[object]] = {
        "died by themselves": died + crew.died,
        "not succeeded": [],
        "two successes": [],
        "moved, yet the cut runner's attempt succeeded": [],
        "incomplete attempts": [],
    }
    for rollout_id in every:
        succeeded = [f for f in h.finished[rollout_id] if f.status == AttemptStatus.SUCCEEDED]
        final_event = h.final(rollout_id)
        entry = live.get(rollout_id)
        if final_event is None or final_event.status != "succeeded" or entry is None:
            problems["not succeeded"].append(rollout_id)
            continue
        if entry["rollout"]["status"] != "succeeded":
            problems["not succeeded"].append((rollout_id, entry["rollout"]["status"]))
        if len(succeeded) != 1:
            problems["two successes"].append((rollout_id, [f.worker_id for f in succeeded]))
        if rollout_id in moved and moved[rollout_id] in [f.attempt_id for f in succeeded]:
            # The cut runner's attempt of work that moved: its end was refused (fenced).
            problems["moved, yet the cut runner's attempt succeeded"].append(rollout_id)
        for a in entry["attempts"]:
            if a["finished_at"] is not None and a["spans_received"] != a["span_count"]:
                problems["incomplete attempts"].append(a["attempt_id"])
    states = store.lineage()
    summary = (
        f"multi-host ({request.config.getoption('--multi-host-size')}): {len(every)} rollouts "
        f"on {len(hosts)} hosts; {len(moved)} moved off a cut runner; "
        f"trainer steps {len(states) - 1}; "
        + ", ".join(f"{k} {v}" for k, v in sorted(notes.items()))
    )
    log = (tmp_path / "logs" / f"{RUNNERS[0]}.log").read_text(errors="replace")
    summary += f"; a cut runner's writes refused as fenced: {log.count('ProducerFenced')}"
    print(summary)
    assert not any(problems.values()), (summary, problems)
    assert moved, "no rollout was in flight on the cut runner: the test proved little"
    assert lineage_problems(states) == []
    assert notes["runner cuts"] == size.runner_cuts and notes["broker cuts"] == size.broker_cuts
