"""Driving runners in tests: in-process or as real processes, and reading what they did."""

from __future__ import annotations

import asyncio
import sys
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition
from aiokafka.partitioner import DefaultPartitioner

from agl_stream.agent.api import LitAgent, load_agent
from agl_stream.bus.streams import Topics, read_partitions
from agl_stream.commands.enqueue import RolloutOptions, enqueue
from agl_stream.commands.resources import Change
from agl_stream.commands.resources import publish_resources as publish_version
from agl_stream.events import (
    AttemptFinished,
    AttemptStarted,
    ResourcesPublished,
    RolloutFinished,
    RolloutQueued,
    SpanRecorded,
)
from agl_stream.runner.worker import Runner, RunnerConfig
from agl_stream.runtime.config import KafkaSettings, child_environment
from tests.support.helpers import eventually


@dataclass
class History:
    """Everything the topics say about rollouts, grouped by rollout id."""

    queued: dict[str, list[RolloutQueued]] = field(default_factory=lambda: defaultdict(list))
    started: dict[str, list[AttemptStarted]] = field(default_factory=lambda: defaultdict(list))
    finished: dict[str, list[AttemptFinished]] = field(default_factory=lambda: defaultdict(list))
    ended: dict[str, list[RolloutFinished]] = field(default_factory=lambda: defaultdict(list))
    spans: dict[str, list[SpanRecorded]] = field(default_factory=lambda: defaultdict(list))

    def final(self, rollout_id: str) -> RolloutFinished | None:
        ends = self.ended.get(rollout_id, [])
        return ends[-1] if ends else None


async def history(kafka: KafkaSettings, with_spans: bool = True) -> History:
    topics = Topics(kafka)
    out = History()
    names = ["tasks", "rollouts"] + (["spans"] if with_spans else [])
    tps = [
        TopicPartition(topics.name(n), p) for n in names for p in range(topics.specs[n].partitions)
    ]
    for event in await read_partitions(kafka, tps):
        if isinstance(event, RolloutQueued):
            out.queued[event.rollout_id].append(event)
        elif isinstance(event, AttemptStarted):
            out.started[event.rollout_id].append(event)
        elif isinstance(event, AttemptFinished):
            out.finished[event.rollout_id].append(event)
        elif isinstance(event, RolloutFinished):
            out.ended[event.rollout_id].append(event)
        elif isinstance(event, SpanRecorded):
            out.spans[event.attempt_id].append(event)
    return out


async def wait_terminal(kafka: KafkaSettings, rollout_ids: Iterable[str], within: float) -> History:
    wanted = set(rollout_ids)
    latest = History()

    async def all_done() -> bool:
        nonlocal latest
        latest = await history(kafka, with_spans=False)
        return wanted <= set(latest.ended)

    await eventually(all_done, within, f"{len(wanted)} rollouts to finish")
    return await history(kafka)


def ids_on_partition(partition: int, partitions: int, count: int, prefix: str) -> list[str]:
    """Rollout ids that the default partitioner puts on one partition."""
    chooser = DefaultPartitioner()
    out: list[str] = []
    i = 0
    while len(out) < count:
        candidate = f"{prefix}-{i}"
        if (
            chooser(candidate.encode(), list(range(partitions)), list(range(partitions)))
            == partition
        ):
            out.append(candidate)
        i += 1
    return out


async def publish_resources(
    kafka: KafkaSettings, resources_id: str, **resources: Any
) -> ResourcesPublished:
    """Publish one version as a user or another algorithm would (resources.py's rule)."""
    change = Change(resources=resources, resources_id=resources_id)
    return await publish_version(kafka, change, published_by="test")


async def queue(kafka: KafkaSettings, tasks: list[Any], **options: Any) -> list[str]:
    return await enqueue(kafka, tasks, RolloutOptions(**options))


@asynccontextmanager
async def runner_in_process(
    kafka: KafkaSettings, agent: str | LitAgent = "tests.support.agents:behave", **config: Any
) -> AsyncIterator[Runner]:
    settings = {"session_timeout_ms": 6000, "heartbeat_seconds": 1.0, "shutdown_grace_seconds": 5.0}
    loaded = load_agent(agent) if isinstance(agent, str) else agent
    runner = Runner(kafka, RunnerConfig(agent=loaded, **{**settings, **config}))
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:
        yield runner
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


async def runner_process(
    kafka: KafkaSettings, name: str, concurrency: int = 8
) -> asyncio.subprocess.Process:
    env = child_environment(kafka)
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agl_stream.cli.main", "worker", "runner",
        "--agent", "tests.support.agents:behave", "--concurrency", str(concurrency),
        "--worker-id", name, "--session-timeout-ms", "6000", "--heartbeat", "1", "--grace", "5",
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def trainer_process(
    kafka: KafkaSettings,
    checkpoints: Path,
    log: Path,
    run_name: str,
    group_size: int,
    groups_per_step: int,
    *extra: str,
) -> asyncio.subprocess.Process:
    """`worker trainer` as a process, its output appended to `log`."""
    with log.open("ab") as out:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agl_stream.cli.main", "worker", "trainer",
            "--checkpoint-dir", str(checkpoints), "--run-name", run_name,
            "--group-size", str(group_size), "--groups-per-step", str(groups_per_step),
            "--heartbeat", "1", *extra, env=child_environment(kafka), stdout=out, stderr=out,
        )  # fmt: skip
