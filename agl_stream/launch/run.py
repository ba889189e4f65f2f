"""The demo's driver: runners, a projector, a trainer and a policy server as separate
processes on the embedded stack; each time the trainer publishes a policy version, one step
of tasks pinned to it is enqueued (on-policy GRPO; with max_staleness 1 the next step's
tasks too, so sampling overlaps training), until the last step. The agent calls the
policy through its runner's gateway, which records the token ids the trainer learns from."""

from __future__ import annotations

import asyncio
import contextlib
import random
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
from aiokafka import TopicPartition
from sqlalchemy.exc import SQLAlchemyError

from agl_stream.bus.kafka import consumer, end_offsets, producer
from agl_stream.bus.streams import EventPublisher, EventStream, Topics
from agl_stream.commands.enqueue import RolloutOptions, make_rollout
from agl_stream.commands.resources import Change, publish_resources
from agl_stream.embedded.process import free_port
from agl_stream.events import LLM, AttemptStatus, ResourcesPublished, RolloutMode
from agl_stream.launch.heldout import EvalPoint, Evaluation, evaluate, publish_result
from agl_stream.queries import QueryError, ReadModel
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings, child_environment

AGENT = "agl_stream.demo.task:echo_letter"


class RunFailed(RuntimeError):
    """The demo cannot go on; the message says why and where to look."""


@dataclass(frozen=True)
class RunConfig:
    steps: int = 30
    groups_per_step: int = 8
    group_size: int = 8
    runners: int = 2
    concurrency: int = 32  # 2 x 32: a step's 64 attempts in one wave (step_latency)
    seed: int = 0
    learning_rate: float = 3e-3
    out_dir: Path = Path(".agl-stream/demo")
    run_name: str = field(default_factory=lambda: f"demo-{uuid.uuid4().hex[:8]}")
    stall_seconds: float = 300.0  # no step for this long: stop and say so
    # 0: on-policy, the tasks of step n wait for version n. 1: they are queued with those of
    # step n-1 (pinned to version n-1), so the runners sample while the trainer trains, and
    # the trainer takes samples one update old (importance weights from their logprobs).
    max_staleness: int = 0
    # What the runners run and on what: the demo's task (agl_stream.demo.task), or a user's
    # (Trainer.fit): a run needs a task source.
    agent: str = AGENT  # MODULE:ATTR
    task_source: Callable[[random.Random, int], Sequence[Any]] | None = None
    extra_env: Mapping[str, str] = field(default_factory=dict)  # PYTHONPATH for the agent
    timeout_seconds: float = 60.0
    algorithm: bool = True  # False: runners and a projector only (Trainer.dev)
    resources: Mapping[str, Any] = field(default_factory=dict)  # published beside `llm`
    dashboard_port: int | None = None  # run `agl-stream dashboard` beside it, on this port
    # The policy server's engine. vLLM's CPU kernels refuse the tiny model's head size of
    # 16: with vllm the trainer starts from the same model with 2 heads of 32.
    engine: str = "torch"
    vllm_args: tuple[str, ...] = ("--vllm-enforce-eager",)
    # A pretrained model (pretrained.py) instead of the tiny one, and what its trainer and
    # policy server are run with (real.py builds these for the real task).
    model: str | None = None
    trainer_args: tuple[str, ...] = ()
    serve_args: tuple[str, ...] = ()
    # The held-out set, evaluated through the pipeline as val rollouts (heldout.py).
    evaluation: Evaluation | None = None
    policy_port: int | None = None  # None: any free port (a benchmark watches a fixed one)

    def __post_init__(self) -> None:
        if self.evaluation is not None and self.max_staleness:
            raise ValueError(
                "a held-out evaluation needs on-policy steps (max_staleness 0): with overlap "
                "the policy server may move to the next version in the middle of it"
            )

    @property
    def init_model(self) -> str:
        if self.model is not None:
            return self.model
        return "tiny-h32" if self.engine == "vllm" else "tiny"

    @property
    def trainer_staleness(self) -> int:
        """With overlap, a group queued early can be trained one update later still (the
        trainer takes the oldest full groups): a bound one higher never drops a sample,
        which would leave its group short for ever."""
        return self.max_staleness + 1 if self.max_staleness else 0

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / self.run_name / "checkpoints"

    @property
    def log_dir(self) -> Path:
        return self.out_dir / self.run_name / "logs"

    @property
    def endpoint_id(self) -> str:
        return f"{self.run_name}-endpoint"


@dataclass(frozen=True)
class StepPoint:
    step: int
    mean_reward: float
    samples: int
    resources_id: str = ""  # the version this step published


def worker_command(role: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "agl_stream.cli.main", "worker", role, *extra]


async def publish_endpoint(kafka: KafkaSettings, config: RunConfig, port: int) -> None:
    """The policy server as the run's LLM resource, published before the trainer starts as
    the latest version and carrying nothing (resources.py): the trainer's versions carry
    this run's endpoint, never an earlier run's (stopped) policy server or checkpoint."""
    llm = LLM(endpoint=f"http://127.0.0.1:{port}/v1", model="policy")
    resources = {**config.resources, "llm": llm}
    change = Change(resources=resources, resources_id=config.endpoint_id, carry=False)
    await publish_resources(kafka, change, published_by="demo")


@contextmanager
def workers(
    config: RunConfig, kafka: KafkaSettings, database: DatabaseSettings, port: int
) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """The run's processes by name, stopped (SIGTERM, then kill) on the way out."""
    env = {**child_environment(kafka, database), **config.extra_env}
    serve = [
        sys.executable, "-m", "agl_stream.cli.main", "serve", "--port", str(port),
        "--engine", config.engine, *(config.vllm_args if config.engine == "vllm" else ()),
        *config.serve_args,
    ]  # fmt: skip
    commands = {
        "policy-server": serve,
        "trainer": worker_command(
            "trainer", "--checkpoint-dir", str(config.checkpoint_dir.resolve()),
            "--run-name", config.run_name, "--group-size", str(config.group_size),
            "--groups-per-step", str(config.groups_per_step),
            "--max-staleness", str(config.trainer_staleness),
            "--learning-rate", str(config.learning_rate), "--seed", str(config.seed),
            "--start", "latest", "--heartbeat", "2", "--init-model", config.init_model,
            *config.trainer_args,
        ),
        "projector": worker_command("projector", "--heartbeat", "2"),
        **{
            f"runner-{i}": worker_command(
                "runner", "--agent", config.agent, "--concurrency", str(config.concurrency),
                "--heartbeat", "2", "--grace", "5",
            )
            for i in range(config.runners)
        },
    }  # fmt: skip
    if not config.algorithm:
        del commands["policy-server"], commands["trainer"]
    if config.dashboard_port is not None:
        commands["dashboard"] = [
            sys.executable, "-m", "agl_stream.cli.main", "dashboard",
            "--port", str(config.dashboard_port),
        ]  # fmt: skip
    with started_processes(commands, env, config.log_dir) as processes:
        yield processes


@contextmanager
def started_processes(
    commands: Mapping[str, Sequence[str]], env: Mapping[str, str], log_dir: Path
) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """One process per command, by name, each logging to `log_dir`/<name>.log; stopped
    (SIGTERM, then kill) on the way out."""
    log_dir.mkdir(parents=True, exist_ok=True)
    processes: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, command in commands.items():
            with (log_dir / f"{name}.log").open("wb") as log:  # the child keeps its copy
                processes[name] = subprocess.Popen(
                    command, env=env, stdout=log, stderr=subprocess.STDOUT
                )
        yield processes
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def drive(
    kafka: KafkaSettings,
    config: RunConfig,
    alive: Callable[[], str | None],
    on_step: Callable[[StepPoint], None],
    policy_url: str | None = None,
    on_eval: Callable[[EvalPoint], None] | None = None,
) -> list[StepPoint]:
    """Follow the trainer's versions; enqueue a step of tasks pinned to each; return the
    mean reward of every step. `alive()` names a worker that died, to stop early. The
    first step waits until the policy server at `policy_url` serves its version (vLLM
    takes a minute or two to start; the attempts would time out meanwhile). With an
    evaluation, a version due for one is evaluated (its held-out set run to the end) before
    the next step's tasks are queued, so that version alone answers it."""
    topics = Topics(kafka)
    tps = [
        TopicPartition(topics.name("resources"), p)
        for p in range(topics.specs["resources"].partitions)
    ]
    rng = random.Random(config.seed)
    points: list[StepPoint] = []
    enqueued: set[int] = set()
    evaluated: set[int] = set()
    ends = await end_offsets(kafka, tps)
    async with consumer(kafka) as follower, producer(kafka, linger_ms=5) as prod:
        publisher = EventPublisher(prod, topics)
        follower.assign(tps)
        for tp in tps:
            follower.seek(tp, ends[tp])
        stream = EventStream(follower, None, topics, "demo")
        loop = asyncio.get_running_loop()
        progressed = loop.time()
        while len(points) < config.steps:
            raise_if_stopped(alive(), config.log_dir)
            if loop.time() - progressed > config.stall_seconds:
                raise RunFailed(
                    f"no training step finished in {config.stall_seconds:.0f} s; the workers' "
                    f"logs are in {config.log_dir}."
                )
            for item in await stream.next_batch(timeout_ms=500):
                event = item.event
                if not isinstance(event, ResourcesPublished):
                    continue
                if not event.resources_id.startswith(f"{config.run_name}-v"):
                    continue
                step = int(event.metadata.get("step", "0"))
                if step > len(points) and "mean_reward" in event.metadata:
                    point = StepPoint(
                        step, float(event.metadata["mean_reward"]),
                        int(event.metadata.get("samples", "0")), event.resources_id,
                    )  # fmt: skip
                    points.append(point)
                    on_step(point)
                    progressed = loop.time()
                # With overlap, version n also gets the tasks of step n + 1 (it is the
                # newest version when they are queued; they train one update later).
                if not enqueued and policy_url is not None:
                    await _served(policy_url, event.resources_id, alive, config)
                    progressed = loop.time()
                judged = config.evaluation
                if judged is not None and judged.due(step, config.steps) and step not in evaluated:
                    evaluated.add(step)
                    result = await evaluate(
                        kafka, publisher, judged, event.resources_id, step, config.run_name
                    )
                    await publish_result(kafka, result, config.run_name)
                    if on_eval is not None:
                        on_eval(result)
                    progressed = loop.time()
                for ahead in range(step, step + 1 + config.max_staleness):
                    if ahead < config.steps and ahead not in enqueued:
                        enqueued.add(ahead)
                        await _enqueue_step(publisher, config, rng, ahead, event.resources_id)
    return points


async def _served(
    url: str, resources_id: str, alive: Callable[[], str | None], config: RunConfig
) -> None:
    """Until the policy server's /health says it serves `resources_id`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.stall_seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while True:
            raise_if_stopped(alive(), config.log_dir)
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                async with session.get(f"{url}/health") as response:
                    health = await response.json()
                if health.get("resources_id") == resources_id:
                    return
                if resources_id in health.get("refused", {}):
                    raise RunFailed(
                        f"the policy server refused {resources_id}: "
                        f"{health['refused'][resources_id]}"
                    )
            if loop.time() > deadline:
                raise RunFailed(
                    f"the policy server did not serve {resources_id} within "
                    f"{config.stall_seconds:.0f} s; its log is in {config.log_dir}"
                )
            await asyncio.sleep(0.2)


async def _enqueue_step(
    publisher: EventPublisher,
    config: RunConfig,
    rng: random.Random,
    step: int,
    resources_id: str,
) -> None:
    """groups_per_step tasks, each queued group_size times: one GRPO group per task."""
    if config.task_source is None:
        raise ValueError("RunConfig.task_source is not set: the run has no tasks to queue")
    await enqueue_groups(
        publisher, config.task_source(rng, config.groups_per_step), resources_id,
        group_size=config.group_size, group_prefix=f"{config.run_name}-s{step}",
        timeout_seconds=config.timeout_seconds,
    )  # fmt: skip


async def enqueue_groups(
    publisher: EventPublisher,
    tasks: Sequence[Any],
    resources_id: str,
    group_size: int,
    group_prefix: str,
    timeout_seconds: float,
    variant: Callable[[Any, int], Any] | None = None,
) -> None:
    """Each task queued group_size times, pinned to `resources_id`: one GRPO group per task,
    named `<group_prefix>-g<i>`; `variant(task, k)` makes the k-th copy (a seed of its own)."""
    sent = []
    for group, task in enumerate(tasks):
        options = RolloutOptions(
            mode=RolloutMode.TRAIN, resources_id=resources_id, timeout_seconds=timeout_seconds,
            # A failed attempt (the policy server busy past the timeout, say) is run
            # again: a rollout lost for good would leave its GRPO group short forever.
            max_attempts=3, retry_condition=(AttemptStatus.FAILED, AttemptStatus.TIMEOUT),
            metadata={"group": f"{group_prefix}-g{group}"},
        )  # fmt: skip
        for k in range(group_size):
            copy = task if variant is None else variant(task, k)
            sent.append(await publisher.send("tasks", make_rollout(copy, options)))
    await asyncio.gather(*sent)


def run_training(
    config: RunConfig,
    kafka: KafkaSettings,
    database: DatabaseSettings,
    on_step: Callable[[StepPoint], None],
    after: Callable[[list[StepPoint]], Awaitable[None]] | None = None,
    on_eval: Callable[[EvalPoint], None] | None = None,
) -> list[StepPoint]:
    """Train for config.steps; then `after(points)` runs while the workers still do (to
    validate the last version, say)."""
    port = config.policy_port or free_port()
    asyncio.run(publish_endpoint(kafka, config, port))
    with workers(config, kafka, database, port) as processes:

        def alive() -> str | None:  # the dashboard is for watching: the run goes on without it
            return first_stopped({k: v for k, v in processes.items() if k != "dashboard"})

        started = datetime.now(UTC)

        async def train() -> list[StepPoint]:
            url = f"http://127.0.0.1:{port}"
            points = await drive(kafka, config, alive, on_step, url, on_eval)
            if after is not None:
                await after(points)
            return points

        try:
            return asyncio.run(train())
        except RunFailed as exc:
            failed = asyncio.run(failures(database, started))
            raise RunFailed(f"{exc}{failed}") from None


def raise_if_stopped(name: str | None, log_dir: Path, error: type[Exception] = RunFailed) -> None:
    """Raise `error` naming a worker that stopped, unless this task is being cancelled: Ctrl-C
    reaches the workers too (one process group), and one may stop before the cancellation
    gets through (a library awaited in between may have swallowed it). Then the run was
    interrupted, not failed: CancelledError, which asyncio.run turns into KeyboardInterrupt."""
    if name is None:
        return
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
    raise error(f"the {name} process stopped; its log is in {log_dir}")


def first_stopped(processes: Mapping[str, subprocess.Popen[bytes]]) -> str | None:
    """The name of a process that is no longer running, if any."""
    for name, process in processes.items():
        if process.poll() is not None:
            return name
    return None


async def failures(database: DatabaseSettings, since: datetime) -> str:
    """What failed for good in this run, as the read model tells it (best effort)."""
    try:
        async with ReadModel.open(database) as model:
            page = await model.rollouts(status=("failed",), since=since, time_field="queued")
    except (OSError, asyncpg.PostgresError, SQLAlchemyError, QueryError):  # only a hint
        return ""
    if not page.items:
        return ""
    first = page.items[0].error or {}
    return (
        f" {len(page.items)}{'+' if page.next_cursor else ''} rollouts failed for good, the "
        f"first with {first.get('type', '?')}: {first.get('message', '?')}"
    )
