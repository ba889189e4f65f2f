"""`Trainer(algorithm=GRPO(...)).fit(agent, train_dataset=..., val_dataset=...)`: training in
Agent Lightning's shape. It uses the configured Kafka and PostgreSQL (AGL_STREAM_BOOTSTRAP_SERVERS
set) or starts the embedded stack, runs runners, a projector, the trainer and its policy
server as processes, shows one progress bar, and stops them all on the way out (SIGTERM,
which lets each finish in flight, then SIGKILL), on Ctrl-C or when one of them dies.
`dev()` runs each task once through runners and a projector, with no training, to try an
agent out. AGL_CURRENT_ROLE splits it across machines as in Agent Lightning: `algorithm`
runs everything but the runners, `runner` only the runners, `both` (the default) all.

Runners are separate processes that import the agent by name: define it at the top level of
a module, and call `fit` under `if __name__ == "__main__":` in a script.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import subprocess
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agl_stream.agent.api import FunctionAgent
from agl_stream.bus.topic_admin import apply_topics
from agl_stream.commands.enqueue import RolloutOptions, enqueue
from agl_stream.commands.resources import Change, publish_resources
from agl_stream.db.migrate import migrate
from agl_stream.embedded.ready import ready_stack
from agl_stream.events import LLM, Checkpoint, PromptTemplate, RolloutMode
from agl_stream.launch.fit_display import Display
from agl_stream.launch.run import (
    RunConfig,
    RunFailed,
    StepPoint,
    first_stopped,
    raise_if_stopped,
    run_training,
    workers,
)
from agl_stream.queries import ReadModel
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings, child_environment, load

ROLES = ("both", "algorithm", "runner")
CHILD_MARK = "AGL_STREAM_FIT_CHILD"  # set in the processes fit starts


class FitError(RuntimeError):
    """fit or dev cannot run or go on; the message says why."""


@dataclass(frozen=True)
class GRPO:
    """GRPO on the policy the trainer learns and its policy server serves."""

    steps: int = 30
    group_size: int = 8
    groups_per_step: int = 8
    learning_rate: float = 3e-3
    max_staleness: int = 0  # 1: sample the next step while training this one
    seed: int = 0
    timeout_seconds: float = 60.0  # per attempt

    def __post_init__(self) -> None:
        for name in ("steps", "group_size", "groups_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"GRPO {name} must be at least 1, not {getattr(self, name)}")
        if self.max_staleness not in (0, 1):
            raise ValueError(f"GRPO max_staleness must be 0 or 1, not {self.max_staleness}")


@dataclass
class FitResult:
    run_name: str
    steps: list[StepPoint] = field(default_factory=list)
    val_reward: float | None = None  # mean over the validation set, on the last version
    rewards: dict[str, float | None] = field(default_factory=dict)  # dev: rollout -> reward
    statuses: dict[str, str] = field(default_factory=dict)  # dev: rollout -> status
    checkpoint_dir: Path | None = None


@dataclass
class Trainer:
    """Train `agent` with `algorithm` (None: dev only) on runners, a projector and the
    algorithm's workers; see the module's docstring."""

    algorithm: GRPO | None = None
    n_runners: int = 2
    concurrency: int = 16
    max_rollouts: int | None = None  # smoke runs: at most about this many rollouts
    initial_resources: Mapping[str, LLM | PromptTemplate | Checkpoint] | None = None
    out_dir: Path = Path(".agl-stream/runs")
    run_name: str = field(default_factory=lambda: f"fit-{uuid.uuid4().hex[:8]}")
    keep_stack: bool = False  # leave an embedded stack this call started running
    on_step: Callable[[StepPoint], None] | None = None
    on_progress: Callable[[int, int], None] | None = None  # dev: (finished, total)

    def __post_init__(self) -> None:
        if self.n_runners < 0 or self.concurrency < 1:
            raise ValueError("Trainer needs n_runners >= 0 and concurrency >= 1")
        if self.max_rollouts is not None and self.max_rollouts < 1:
            raise ValueError(f"Trainer max_rollouts must be at least 1, not {self.max_rollouts}")

    def fit(
        self,
        agent: Any,
        train_dataset: Sequence[Any],
        val_dataset: Sequence[Any] | None = None,
    ) -> FitResult:
        """Train on `train_dataset` (each step samples groups_per_step tasks, each run
        group_size times); with `val_dataset`, the last version's mean reward on it."""
        if not isinstance(self.algorithm, GRPO):
            raise FitError("fit needs an algorithm: Trainer(algorithm=GRPO(...)); dev() runs none")
        return self._run(agent, train_dataset, val_dataset, train=True)

    def dev(
        self,
        agent: Any,
        train_dataset: Sequence[Any],
        val_dataset: Sequence[Any] | None = None,
    ) -> FitResult:
        """Each task once (up to max_rollouts), no training: rewards and statuses by rollout."""
        return self._run(agent, train_dataset, val_dataset, train=False)

    # -- the run -----------------------------------------------------------------------------

    def _run(
        self,
        agent: Any,
        train_dataset: Sequence[Any],
        val_dataset: Sequence[Any] | None,
        *,
        train: bool,
    ) -> FitResult:
        if os.environ.get(CHILD_MARK):
            raise FitError(
                "Trainer.fit ran inside one of its own runners, which imported your script to "
                'find the agent: call fit under `if __name__ == "__main__":`'
            )
        role = fit_role()
        if not train_dataset:
            raise FitError("train_dataset is empty: give at least one task")
        spec, env = agent_reference(agent)
        kafka, database, stop_stack = self._connect()
        try:
            if role == "runner":
                return self._runners_only(spec, env, kafka)
            runners = 0 if role == "algorithm" else self.n_runners
            if train:
                return self._grpo(spec, env, runners, kafka, database, train_dataset, val_dataset)
            return self._dev(spec, env, runners, kafka, database, train_dataset, val_dataset)
        finally:
            stop_stack()

    def _connect(self) -> tuple[KafkaSettings, DatabaseSettings, Callable[[], None]]:
        if "AGL_STREAM_BOOTSTRAP_SERVERS" in os.environ:  # a configured Kafka and database
            kafka, database = load(KafkaSettings), load(DatabaseSettings)
            asyncio.run(apply_topics(kafka))
            asyncio.run(migrate(database))
            return kafka, database, lambda: None
        ready = ready_stack()

        def stop() -> None:
            if ready.started and not self.keep_stack:
                ready.stack.down()

        return ready.kafka, ready.database, stop

    def _config(self, spec: str, env: Mapping[str, str], runners: int, **more: Any) -> RunConfig:
        return RunConfig(
            runners=runners, concurrency=self.concurrency, out_dir=self.out_dir,
            run_name=self.run_name, agent=spec, extra_env=env,
            resources=dict(self.initial_resources or {}), **more,
        )  # fmt: skip

    def _grpo(
        self,
        spec: str,
        env: Mapping[str, str],
        runners: int,
        kafka: KafkaSettings,
        database: DatabaseSettings,
        train_dataset: Sequence[Any],
        val_dataset: Sequence[Any] | None,
    ) -> FitResult:
        algo = self.algorithm
        assert algo is not None
        per_step = algo.group_size * algo.groups_per_step
        steps = algo.steps
        if self.max_rollouts is not None:
            steps = max(1, min(steps, self.max_rollouts // per_step))
        config = self._config(
            spec, env, runners, steps=steps, groups_per_step=algo.groups_per_step,
            group_size=algo.group_size, seed=algo.seed, learning_rate=algo.learning_rate,
            max_staleness=algo.max_staleness, task_source=DatasetSampler(train_dataset),
            timeout_seconds=algo.timeout_seconds,
        )  # fmt: skip
        result = FitResult(self.run_name, checkpoint_dir=config.checkpoint_dir)
        display = Display(f"fit {self.run_name}", steps, "steps")

        def on_step(point: StepPoint) -> None:
            display.update(point.step, f"mean reward {point.mean_reward:.3f}")
            if self.on_step is not None:
                self.on_step(point)

        async def validate(points: list[StepPoint]) -> None:
            if val_dataset:
                display.start(len(self._capped(val_dataset)), "validation rollouts")
                ids = await enqueue(
                    kafka, self._capped(val_dataset),
                    RolloutOptions(mode=RolloutMode.VAL, resources_id=points[-1].resources_id,
                                   timeout_seconds=algo.timeout_seconds),
                )  # fmt: skip
                rows = await self._wait(database, ids, display, lambda: None)
                result.val_reward = _mean_reward(rows)

        with display:
            try:
                result.steps = run_training(config, kafka, database, on_step, validate)
            except RunFailed as exc:
                raise FitError(str(exc)) from None
        return result

    def _dev(
        self,
        spec: str,
        env: Mapping[str, str],
        runners: int,
        kafka: KafkaSettings,
        database: DatabaseSettings,
        train_dataset: Sequence[Any],
        val_dataset: Sequence[Any] | None,
    ) -> FitResult:
        config = self._config(spec, env, runners, algorithm=False)
        train_tasks = self._capped(train_dataset)
        val_tasks = self._capped(val_dataset or [])
        result = FitResult(self.run_name)
        display = Display(f"dev {self.run_name}", len(train_tasks) + len(val_tasks), "rollouts")

        async def run(processes: Mapping[str, subprocess.Popen[bytes]]) -> None:
            resources_id = None
            if self.initial_resources:
                resources_id = f"{self.run_name}-initial"
                change = Change(dict(self.initial_resources), resources_id, carry=False)
                await publish_resources(kafka, change, published_by="fit")
            ids = await enqueue(kafka, train_tasks, RolloutOptions(resources_id=resources_id))
            val_ids = []
            if val_tasks:
                options = RolloutOptions(mode=RolloutMode.VAL, resources_id=resources_id)
                val_ids = await enqueue(kafka, val_tasks, options)

            def died() -> None:
                raise_if_stopped(first_stopped(processes), config.log_dir, FitError)

            rows = await self._wait(database, ids + val_ids, display, died)
            result.rewards = {i: rows[i].reward for i in ids}
            result.statuses = {i: rows[i].status for i in ids}
            if val_ids:
                result.val_reward = _mean_reward({i: rows[i] for i in val_ids})

        with display, workers(config, kafka, database, 0) as processes:
            asyncio.run(run(processes))
        return result

    def _runners_only(self, spec: str, env: Mapping[str, str], kafka: KafkaSettings) -> FitResult:
        """AGL_CURRENT_ROLE=runner: this machine's runners, until they stop or Ctrl-C."""
        command = [
            sys.executable, "-m", "agl_stream.cli.main", "worker", "runner",
            "--agent", spec, "--concurrency", str(self.concurrency),
        ]  # fmt: skip
        environment = {**child_environment(kafka), **env}
        processes = [subprocess.Popen(command, env=environment) for _ in range(self.n_runners)]
        try:
            for process in processes:
                process.wait()
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                try:
                    process.wait(timeout=40)
                except subprocess.TimeoutExpired:
                    process.kill()
        return FitResult(self.run_name)

    def _capped(self, tasks: Sequence[Any]) -> list[Any]:
        return list(tasks)[: self.max_rollouts] if self.max_rollouts else list(tasks)

    async def _wait(
        self,
        database: DatabaseSettings,
        ids: list[str],
        display: Display,
        check: Callable[[], None],
    ) -> dict[str, Any]:
        """Wait for the rollouts to finish (as the read model tells it); their rows."""
        async with ReadModel.open(database) as model:
            while True:
                check()
                try:
                    await model.wait_for_rollouts(
                        ids, within=5.0, on_progress=lambda done, _: display.update(done)
                    )
                    break
                except TimeoutError:
                    continue
            return await model.rollouts_by_id(ids)


def _mean_reward(rows: Mapping[str, Any]) -> float:
    """A rollout without a reward (failed) counts 0, as Agent Lightning's APO counts it."""
    rewards = [row.reward or 0.0 for row in rows.values()]
    return sum(rewards) / len(rewards) if rewards else math.nan


class DatasetSampler:
    """groups_per_step tasks per step: the dataset shuffled, walked through, reshuffled at
    the end of each pass (an epoch), so every task is used once per epoch."""

    def __init__(self, dataset: Sequence[Any]) -> None:
        self.dataset = list(dataset)
        self._order: list[int] = []

    def __call__(self, rng: random.Random, count: int) -> list[Any]:
        out = []
        for _ in range(count):
            if not self._order:
                self._order = list(range(len(self.dataset)))
                rng.shuffle(self._order)
            out.append(self.dataset[self._order.pop()])
        return out


def fit_role() -> str:
    """AGL_CURRENT_ROLE as Agent Lightning reads it (both, algorithm or runner)."""
    role = os.environ.get("AGL_CURRENT_ROLE", "both").strip().lower() or "both"
    if role not in ROLES:
        raise FitError(
            f"AGL_CURRENT_ROLE={role!r}: Trainer.fit takes {', '.join(ROLES)} (agl-stream's "
            "worker roles go to `agl-stream worker --role`)"
        )
    return role


def agent_reference(agent: Any) -> tuple[str, dict[str, str]]:
    """How a runner process finds `agent`: MODULE:ATTR, and the environment that makes the
    module importable there (this process's import path; a script's own directory)."""
    paths = [p for p in sys.path if p]
    if isinstance(agent, str):
        return agent, {"PYTHONPATH": os.pathsep.join(paths), CHILD_MARK: "1"}
    target = agent.func if isinstance(agent, FunctionAgent) else agent
    module_name = getattr(target, "__module__", None) or type(target).__module__
    module = sys.modules.get(module_name)
    if module_name == "__main__":
        path = getattr(module, "__file__", None)
        if path is None:
            raise FitError(
                "the agent is defined in an interactive session; runners are separate "
                "processes that import it by name: define it in a module or a script"
            )
        module_name = Path(path).stem
        paths.insert(0, str(Path(path).resolve().parent))
    for name, value in vars(module).items() if module is not None else ():
        if value is agent or value is target:
            env = {"PYTHONPATH": os.pathsep.join(paths), CHILD_MARK: "1"}
            return f"{module_name}:{name}", env
    raise FitError(
        f"cannot find the agent {agent!r} at the top level of module {module_name}; runners "
        "are separate processes that import it by name: define it at the top level"
    )
