"""The two-agent demo's driver: two policies trained together on the referential game
(agl_stream.demo.game). Runners, a projector and a trainer process holding both policies run
as separate processes on the embedded stack; each policy's trainer trains only on its own
policy's LLM calls and publishes its own lineage of versions. Per step n the driver waits
until both trainers have published their step-n checkpoint, publishes a joint version holding
the two, and queues step n's tasks pinned to it: every rollout is played by the two
checkpoints of one step.
At the end, the swap check: the trained pair against each trained policy paired with the
other's initial checkpoint."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from agl_stream.bus.kafka import consumer, end_offsets, producer
from agl_stream.bus.streams import EventPublisher, EventStream, Topics
from agl_stream.commands.resources import Change, ResourcesPublisher, resources_partition
from agl_stream.demo.game import LISTENER, POLICIES, SPEAKER, joint_reward, seeded, tasks
from agl_stream.events import Checkpoint, ResourcesPublished
from agl_stream.launch.run import (
    RunFailed,
    StepPoint,
    enqueue_groups,
    failures,
    first_stopped,
    raise_if_stopped,
    started_processes,
    worker_command,
)
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings, child_environment

AGENT = "agl_stream.demo.game:referential_game"
FIRST_SEED = 1  # the speaker's initial weights; the listener's: the next seed
SEEDS = {policy: FIRST_SEED + i for i, policy in enumerate(POLICIES)}
# The swap check's pairs: (speaker, listener), each trained or initial.
PAIRS = (("trained", "trained"), ("initial", "trained"), ("trained", "initial"))


@dataclass(frozen=True)
class TwoPolicyConfig:
    steps: int = 30
    # 16, not the one-policy demo's 8 (benchmarks/two_policies_offline.py, offline, 24
    # sampling seeds of 16 steps): with 16 groups 23 learned (last tenth >= 2x the first),
    # one collapsed (the speaker saying one word for most letters); with 8 groups, 2 of 6
    # runs of 20 steps ended under 2x. Seeded (each attempt's draws from its task's seed), a
    # run on one machine trains the same every time.
    groups_per_step: int = 16
    group_size: int = 8
    runners: int = 2
    concurrency: int = 32
    seed: int = 0  # the tasks and the swap check's games
    first_seed: int = FIRST_SEED  # the policies' initial weights: this seed, then the next
    learning_rate: float = 3e-3
    out_dir: Path = Path(".agl-stream/demo")
    run_name: str = field(default_factory=lambda: f"game-{uuid.uuid4().hex[:8]}")
    stall_seconds: float = 300.0  # no step for this long: stop and say so
    timeout_seconds: float = 60.0
    swap_games: int = 500

    def checkpoint_dir(self, policy: str) -> Path:
        return self.out_dir / self.run_name / "checkpoints" / policy

    @property
    def log_dir(self) -> Path:
        return self.out_dir / self.run_name / "logs"

    @property
    def joint_prefix(self) -> str:
        return f"{self.run_name}-joint"


@dataclass(frozen=True)
class JointStep:
    """Step n: each policy's step-n version (its trainer's mean reward and samples, from the
    rollouts of step n - 1) and the joint version that holds the two checkpoints."""

    step: int
    points: Mapping[str, StepPoint]
    resources_id: str

    @property
    def mean_reward(self) -> float:
        """The joint reward: both trainers trained on the same rollouts, so their means agree."""
        return sum(p.mean_reward for p in self.points.values()) / len(self.points)


@dataclass(frozen=True)
class Swap:
    speaker: str  # "trained" or "initial"
    listener: str
    reward: float


@dataclass(frozen=True)
class TwoPolicyResult:
    steps: list[JointStep]
    swaps: list[Swap]
    # Each policy's checkpoints, initial (step 0) and trained (the last step).
    checkpoints: Mapping[str, Mapping[str, Checkpoint]]

    def points(self, policy: str) -> list[StepPoint]:
        """One policy's curve (curve.tenths and plot take it)."""
        return [s.points[policy] for s in self.steps]

    def joint_points(self) -> list[StepPoint]:
        """The joint reward's curve, each step's point naming its joint version."""
        return [
            StepPoint(
                s.step, s.mean_reward, min(p.samples for p in s.points.values()), s.resources_id
            )
            for s in self.steps
        ]


@dataclass
class Pairing:
    """The trainers' versions of one run, by policy and step (pure: folds the events)."""

    run_name: str
    versions: dict[tuple[str, int], ResourcesPublished] = field(default_factory=dict)

    def add(self, event: ResourcesPublished) -> None:
        meta = event.metadata
        policy = meta.get("policy")
        if meta.get("run_name") != self.run_name or policy not in POLICIES or "step" not in meta:
            return
        if not isinstance(event.resources.get(policy), Checkpoint):
            return
        self.versions.setdefault((policy, int(meta["step"])), event)

    def ready(self, step: int) -> dict[str, ResourcesPublished] | None:
        """Both policies' step-`step` versions, once both are published."""
        found = {p: self.versions.get((p, step)) for p in POLICIES}
        if any(v is None for v in found.values()):
            return None
        return {p: v for p, v in found.items() if v is not None}

    def checkpoint(self, policy: str, step: int) -> Checkpoint:
        found = self.versions[(policy, step)].resources[policy]
        assert isinstance(found, Checkpoint)
        return found


def joint_change(
    config: TwoPolicyConfig, step: int, pair: Mapping[str, ResourcesPublished]
) -> Change:
    """The version step `step`'s tasks are pinned to: the two step-`step` checkpoints alone.
    Its metadata names the run and step as joint_run and joint_step, not run_name and step:
    those make a version a trainer's, a point of a run's curve (the dashboard's runs.py)."""
    metadata = {"joint_run": config.run_name, "joint_step": str(step)}
    metadata.update({f"{p}_resources_id": pair[p].resources_id for p in POLICIES})
    return Change(
        resources={p: pair[p].resources[p] for p in POLICIES}, id_prefix=config.joint_prefix,
        carry=False, metadata=metadata,
        same_as=lambda v: v.metadata.get("joint_run") == config.run_name
        and v.metadata.get("joint_step") == str(step),
    )  # fmt: skip


def joint_step(step: int, pair: Mapping[str, ResourcesPublished], joint_id: str) -> JointStep:
    points = {p: _point(step, v) for p, v in pair.items()}
    return JointStep(step, points, joint_id)


def _point(step: int, version: ResourcesPublished) -> StepPoint:
    meta = version.metadata
    mean = float(meta.get("mean_reward", "nan"))
    return StepPoint(step, mean, int(meta.get("samples", "0")), version.resources_id)


def commands(config: TwoPolicyConfig) -> dict[str, list[str]]:
    """The run's processes: a projector, a trainer per policy, the runners."""
    shared = [
        "--run-name", config.run_name, "--group-size", str(config.group_size),
        "--groups-per-step", str(config.groups_per_step), "--max-staleness", "0",
        "--learning-rate", str(config.learning_rate), "--start", "latest",
        "--heartbeat", "2", "--init-model", "tiny",
    ]  # fmt: skip
    found = {"projector": worker_command("projector", "--heartbeat", "2")}
    # One trainer process holds both policies (each its own consumer group, checkpoints in
    # <checkpoint dir>/<policy> and versions; seeds --seed, --seed + 1 in POLICIES' order).
    directory = str(config.checkpoint_dir(POLICIES[0]).parent.resolve())
    policies = [arg for p in POLICIES for arg in ("--policy", p)]
    seed = str(config.first_seed)
    found["trainer"] = worker_command(
        "trainer", *policies, "--seed", seed, "--checkpoint-dir", directory, *shared
    )
    runner = ["--agent", AGENT, "--concurrency", str(config.concurrency), "--heartbeat", "2"]
    for i in range(config.runners):
        found[f"runner-{i}"] = worker_command("runner", *runner, "--grace", "5")
    return found


async def drive(
    kafka: KafkaSettings,
    config: TwoPolicyConfig,
    alive: Callable[[], str | None],
    on_step: Callable[[JointStep], None],
    start: int,
) -> tuple[list[JointStep], Pairing]:
    """Follow the resources topic from offset `start`; for each step whose two versions are
    out, publish the joint version and queue the step's tasks pinned to it."""
    topics = Topics(kafka)
    tp = resources_partition(kafka)
    rng = random.Random(config.seed)
    pairing = Pairing(config.run_name)
    steps: list[JointStep] = []
    step = 0  # the next joint version to publish (the last, config.steps, gets no tasks)
    async with (
        consumer(kafka) as follower,
        producer(kafka, linger_ms=5) as prod,
        ResourcesPublisher(kafka, "demo") as resources,
    ):
        publisher = EventPublisher(prod, topics)
        follower.assign([tp])
        follower.seek(tp, start)
        stream = EventStream(follower, None, topics, "demo")
        loop = asyncio.get_running_loop()
        progressed = loop.time()
        while step <= config.steps:
            raise_if_stopped(alive(), config.log_dir)
            if loop.time() - progressed > config.stall_seconds:
                raise RunFailed(
                    f"no training step finished in {config.stall_seconds:.0f} s; the workers' "
                    f"logs are in {config.log_dir}."
                )
            for item in await stream.next_batch(timeout_ms=500):
                if isinstance(item.event, ResourcesPublished):
                    pairing.add(item.event)
            while step <= config.steps and (pair := pairing.ready(step)) is not None:
                joint = await resources.publish(joint_change(config, step, pair))
                if step > 0:
                    steps.append(joint_step(step, pair, joint.resources_id))
                    on_step(steps[-1])
                if step < config.steps:
                    await enqueue_groups(
                        publisher, tasks(rng, config.groups_per_step), joint.resources_id,
                        group_size=config.group_size, group_prefix=f"{config.run_name}-s{step}",
                        timeout_seconds=config.timeout_seconds, variant=seeded(rng),
                    )  # fmt: skip
                step += 1
                progressed = loop.time()
    return steps, pairing


def swap_check(
    checkpoints: Mapping[str, Mapping[str, Checkpoint]], games: int, seed: int
) -> list[Swap]:
    """The joint reward of each pair in PAIRS over the same `games` seeded games."""
    from agl_stream.training.local_llm import load_checkpoint

    loaded = {}
    for policy, which in checkpoints.items():
        for name, checkpoint in which.items():
            loaded[(policy, name)] = load_checkpoint(checkpoint)
            loaded[(policy, name)].model.eval()
    return [
        Swap(
            s,
            lis,
            joint_reward(loaded[SPEAKER, s], loaded[LISTENER, lis], random.Random(seed), games),
        )
        for s, lis in PAIRS
    ]


async def _resources_end(kafka: KafkaSettings) -> int:
    tp = resources_partition(kafka)
    return (await end_offsets(kafka, [tp]))[tp]


def run_two_policies(
    config: TwoPolicyConfig,
    kafka: KafkaSettings,
    database: DatabaseSettings,
    on_step: Callable[[JointStep], None],
) -> TwoPolicyResult:
    """Train both policies for config.steps; then the swap check (while the workers stop)."""
    # Read before the trainers start: their step-0 versions come after it.
    start = asyncio.run(_resources_end(kafka))
    env = child_environment(kafka, database)
    with started_processes(commands(config), env, config.log_dir) as processes:
        began = datetime.now(UTC)
        try:
            steps, pairing = asyncio.run(
                drive(kafka, config, lambda: first_stopped(processes), on_step, start)
            )
        except RunFailed as exc:
            failed = asyncio.run(failures(database, began))
            raise RunFailed(f"{exc}{failed}") from None
        for process in processes.values():  # they stop while the swap check runs (seconds)
            process.terminate()
        checkpoints = {
            p: {"initial": pairing.checkpoint(p, 0), "trained": pairing.checkpoint(p, config.steps)}
            for p in POLICIES
        }
        swaps = swap_check(checkpoints, config.swap_games, config.seed)
    return TwoPolicyResult(steps, swaps, checkpoints)


__all__ = [
    "JointStep",
    "Pairing",
    "Swap",
    "TwoPolicyConfig",
    "TwoPolicyResult",
    "run_two_policies",
]
