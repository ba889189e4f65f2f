"""The pieces of the chaos test: a crew of real worker processes that can be killed and
restarted, the faults, and the one-screen summary."""

from __future__ import annotations

import asyncio
import random
import signal
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agl_stream.bus.codec import Codec
from agl_stream.bus.dead_letters import REASON, SOURCE_PARTITION
from agl_stream.bus.kafka import producer
from agl_stream.bus.streams import Topics
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings, child_environment
from tests.support.bad_records import EVENT_TOPICS, bad_records

AGENT = "tests.support.agents:chaos_echo"
RUN = "chaos"
GROUP_SIZE, GROUPS_PER_STEP = 4, 4


@dataclass(frozen=True)
class ChaosSize:
    rollouts: int
    runners: int
    enqueue_seconds: float  # the tasks trickle in over this long, as from a live system
    fault_every: tuple[float, float]  # seconds between faults, drawn uniformly
    finish_within: float  # after the last task is queued


SIZES = {
    "ci": ChaosSize(rollouts=200, runners=3, enqueue_seconds=20, fault_every=(3, 6),
                    finish_within=240),
    "long": ChaosSize(rollouts=3000, runners=4, enqueue_seconds=300, fault_every=(4, 12),
                      finish_within=600),
}  # fmt: skip

FAULTS = (
    "runner killed",
    "projector killed",
    "trainer killed",
    "broker killed",
    "broker paused",
    "malformed",
)


@dataclass
class Member:
    role: str
    name: str
    process: asyncio.subprocess.Process
    log: Path


class Crew:
    """Runner, projector and trainer processes, each writing to a log of its own; kill -9
    and restart any of them, and notice one that died by itself."""

    def __init__(
        self,
        kafka: KafkaSettings,
        database: DatabaseSettings,
        logs: Path,
        checkpoints: Path,
        agent: str = AGENT,
    ) -> None:
        self.env = child_environment(kafka, database)
        self.agent = agent
        self.logs = logs
        self.checkpoints = checkpoints
        self.members: dict[str, Member] = {}
        self.restarts: Counter[str] = Counter()
        self.died: list[str] = []  # "name: last lines of its log"
        logs.mkdir(parents=True, exist_ok=True)

    def _args(self, role: str, name: str) -> list[str]:
        common = ["--worker-id", name, "--heartbeat", "1", "--session-timeout-ms", "6000"]
        if role == "runner":
            return ["--agent", self.agent, "--concurrency", "8", "--grace", "5", *common]
        if role == "projector":
            return ["--batch-size", "500", *common]
        return [
            "--checkpoint-dir", str(self.checkpoints), "--run-name", RUN,
            "--group-size", str(GROUP_SIZE), "--groups-per-step", str(GROUPS_PER_STEP),
            "--worker-id", name, "--heartbeat", "1",
        ]  # fmt: skip

    async def start(self, role: str, name: str) -> None:
        log = self.logs / f"{name}.log"
        with log.open("ab") as out:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "agl_stream.cli.main", "worker", role,
                *self._args(role, name), env=self.env, stdout=out, stderr=out,
            )  # fmt: skip
        self.members[name] = Member(role, name, process, log)

    def of(self, role: str) -> list[Member]:
        return [m for m in self.members.values() if m.role == role]

    async def kill(self, member: Member, rng: random.Random) -> None:
        """kill -9, then start it again under the same name after a moment."""
        member.process.send_signal(signal.SIGKILL)
        await member.process.wait()
        await asyncio.sleep(rng.uniform(0.2, 2.0))
        await self.start(member.role, member.name)
        self.restarts[member.role] += 1

    async def revive_the_dead(self) -> None:
        """A worker that exited without being told is a bug: note it, start it again."""
        for member in list(self.members.values()):
            if member.process.returncode is not None:
                tail = member.log.read_text(errors="replace")[-1500:]
                self.died.append(f"{member.name} (exit {member.process.returncode}): {tail}")
                await self.start(member.role, member.name)

    async def stop(self, role: str) -> None:
        """SIGTERM every member of a role and wait for each to exit cleanly."""
        members = self.of(role)
        for member in members:
            if member.process.returncode is None:
                member.process.send_signal(signal.SIGTERM)
        for member in members:
            try:
                code = await asyncio.wait_for(member.process.wait(), 90)
            except TimeoutError:
                member.process.send_signal(signal.SIGKILL)
                await member.process.wait()
                tail = member.log.read_text(errors="replace")[-1500:]
                self.died.append(f"{member.name} did not exit within 90 s of SIGTERM: {tail}")
                continue
            if code != 0:
                tail = member.log.read_text(errors="replace")[-1500:]
                self.died.append(f"{member.name} exited {code} on SIGTERM: {tail}")

    async def stop_all(self) -> None:
        for member in self.members.values():
            if member.process.returncode is None:
                member.process.send_signal(signal.SIGKILL)
                await member.process.wait()


async def inject_malformed(kafka: KafkaSettings, codec: Codec) -> dict[tuple[str, int, int], str]:
    """Every kind of bad record into every event topic, and some into the dead-letter topic
    itself (a dead-letter reader must show them, not crash); returns where each event-topic
    record landed and which kind it is."""
    topics = Topics(kafka)
    sent: dict[tuple[str, int, int], str] = {}
    async with producer(kafka) as prod:
        for short in EVENT_TOPICS:
            for label, value in bad_records(codec, short).items():
                meta = await prod.send_and_wait(
                    topics.name(short), value, key=f"chaos-{label}".encode()
                )
                sent[(meta.topic, meta.partition, meta.offset)] = label
        for value in bad_records(codec, "spans").values():
            headers = [(SOURCE_PARTITION, b"not a number"), (REASON, b"\xff\xfe")]
            await prod.send_and_wait(topics.name("dlq"), value, headers=headers)
    return sent


@dataclass
class Summary:
    size: str
    config: ChaosSize
    brokers: str = "1 Kafka node"
    seconds: float = 0.0
    statuses: Counter[str] = field(default_factory=Counter)
    attempts: int = 0
    reruns: int = 0  # attempts beyond one per rollout: retries and re-runs after kills
    second_successes: int = 0  # rollouts run to success twice (counted once)
    spans: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    paused_seconds: float = 0.0
    controller_kills: int = 0  # of the "broker killed" faults, those of the active controller
    restarts: Counter[str] = field(default_factory=Counter)
    died: int = 0
    malformed_sent: int = 0
    malformed_found: int = 0
    dead_letters: int = 0
    trainer_steps: int = 0
    trained_attempts: int = 0
    replay_rows: dict[str, int] = field(default_factory=dict)
    lost: dict[str, list[Any]] = field(default_factory=dict)  # what -> examples

    @property
    def lost_count(self) -> int:
        return sum(len(v) for v in self.lost.values())

    def render(self) -> str:
        c = self.config
        faults = ", ".join(f"{k} x{self.faults[k]}" for k in FAULTS if self.faults[k])
        restarts = ", ".join(f"{k} {v}" for k, v in sorted(self.restarts.items())) or "none"
        statuses = ", ".join(f"{v} {k}" for k, v in sorted(self.statuses.items()))
        lost = (
            "0"
            if not self.lost_count
            else "; ".join(f"{k}: {len(v)} (e.g. {v[:3]})" for k, v in self.lost.items() if v)
        )
        rows = [
            f"chaos ({self.size}): {c.rollouts:,} rollouts queued over {c.enqueue_seconds:.0f} s, "
            f"{c.runners} runners, 1 projector, 1 trainer, {self.brokers}; "
            f"{self.seconds:.0f} s in all",
            f"  rollouts      {sum(self.statuses.values()):,} terminal: {statuses}",
            f"  attempts      {self.attempts:,} ({self.reruns:,} beyond one per rollout: "
            f"retries and re-runs after kills; {self.second_successes} rollouts run to success "
            "twice)",
            f"  spans         {self.spans:,} in the read model"
            + ("" if self.lost.get("incomplete attempts") else ", every finished attempt complete"),
            f"  faults        {sum(self.faults.values())}: {faults} "
            f"(the active controller among the brokers killed x{self.controller_kills}; "
            f"a broker paused {self.paused_seconds:.1f} s in all)",
            f"  restarts      {restarts}; workers that died by themselves: {self.died}",
            f"  dead letters  {self.malformed_sent} malformed records sent, "
            f"{self.malformed_found} found with a reason "
            f"({self.dead_letters} letters in all: each consumer group writes its own)",
            f"  trainer       {self.trainer_steps} steps, {self.trained_attempts:,} attempts "
            "trained on, each offset range consumed once",
            "  read model    equals a replay from scratch: "
            + ", ".join(f"{v:,} {k}" for k, v in self.replay_rows.items()),
            f"  lost          {lost}",
        ]
        return "\n".join(rows)
