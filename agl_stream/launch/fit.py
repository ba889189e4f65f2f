"""`Trainer(algorithm=GRPO(...)).fit(agent, train_dataset=..., val_dataset=...)`: training in
Agent Lightning's shape. It uses the configured Kafka and PostgreSQL (AGL_STREAM_BOOTSTRAP_SERVERS
set) or starts the embedded stack, runs runners, a projector, the trainer and its policy
server as processes, shows one progress bar, and stops them all on the way out (SIGTERM,
which lets each finish in flight, then SIGKILL), on Ctrl-C or when one of them dies.
With APO(...) or Agent Lightning's agl.APO(...) (fit_apo.py) it runs agl-stream's APO in this
process instead of the trainer and its policy server, on the prompt template in
initial_resources.
`dev()` runs each task once through runners and a projector, with no training, to try an
agent out. AGL_CURRENT_ROLE splits it across machines as in Agent Lightning: `algorithm`
runs everything but the runners, `runner` only the runners, `both` (the default) all.

Runners are separate processes that import the agent by name: define it at the top level of
a module, and call `fit` under `if __name__ == "__main__":` in a script.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from agl_stream.agent.api import FunctionAgent
from agl_stream.bus.topic_admin import apply_topics
from agl_stream.commands.enqueue import RolloutOptions, enqueue
from agl_stream.commands.resources import Change, publish_resources
from agl_stream.db.migrate import migrate
from agl_stream.db.outage import riding_out
from agl_stream.embedded.ready import ready_stack
from agl_stream.events import LLM, Checkpoint, PromptTemplate, RolloutMode
from agl_stream.events.resources import Resource
from agl_stream.launch.fit_apo import (
    APO,
    ApoPlan,
    from_agent_lightning,
    plan_apo,
    stream_resources,
    tell_agent_lightning,
)
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
from agl_stream.training.apo.optimizer import Apo, ApoError, RoundReport
from agl_stream.training.apo.search import ApoState
from agl_stream.training.trajectories import LateRewardRule, MissingLateReward

ROLES = ("both", "algorithm", "runner")
CHILD_MARK = "AGL_STREAM_FIT_CHILD"  # set in the processes fit starts
T = TypeVar("T")


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
    # Train on the reward of this name given after the attempt (RewardRecorded), as
    # `worker trainer --late-reward` does: the trainer process applies the rule.
    late_reward: LateRewardRule | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "group_size", "groups_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"GRPO {name} must be at least 1, not {getattr(self, name)}")
        if self.max_staleness not in (0, 1):
            raise ValueError(f"GRPO max_staleness must be 0 or 1, not {self.max_staleness}")
        if self.late_reward is not None and not isinstance(self.late_reward, LateRewardRule):
            raise ValueError(
                f"GRPO late_reward must be a LateRewardRule(name, wait_seconds, missing), not "
                f"{self.late_reward!r}"
            )

    def trainer_args(self) -> tuple[str, ...]:
        """The trainer process's options that carry what its flags have no default for."""
        rule = self.late_reward
        if rule is None:
            return ()
        return (
            "--late-reward", rule.name, "--late-reward-wait", str(rule.wait_seconds),
            "--late-reward-missing", rule.missing.value,
        )  # fmt: skip

    def stall_hint(self) -> str:
        """Why steps may stop coming that the workers' logs do not say."""
        rule = self.late_reward
        if rule is None or rule.missing is not MissingLateReward.DROP:
            return ""
        return (
            f" (late_reward {rule.name!r} drops a trajectory whose reward did not come within "
            f"{rule.wait_seconds:g} s, and fit queues no more attempts for its group, so the "
            "step never fills: give every train rollout its reward in time, or use "
            "MissingLateReward.FINAL)"
        )


@dataclass
class FitResult:
    run_name: str
    steps: list[StepPoint] = field(default_factory=list)  # APO: one per round (0: the seed)
    val_reward: float | None = None  # mean over the validation set, on the last version
    rewards: dict[str, float | None] = field(default_factory=dict)  # dev: rollout -> reward
    statuses: dict[str, str] = field(default_factory=dict)  # dev: rollout -> status
    checkpoint_dir: Path | None = None  # APO: where its state is
    best_prompt: PromptTemplate | None = None  # APO: the best template, published as...
    resources_id: str | None = None  # ...this version, the latest when it was published


@dataclass
class Trainer:
    """Train `agent` with `algorithm` (None: dev only) on runners, a projector and the
    algorithm's workers; see the module's docstring."""

    # GRPO(...), APO(...) or Agent Lightning's agl.APO(...); None: dev only.
    algorithm: GRPO | APO | Any = None
    n_runners: int = 2
    concurrency: int = 16
    max_rollouts: int | None = None  # smoke runs: at most about this many rollouts
    # agl-stream's resources, or Agent Lightning's LLM and PromptTemplate.
    initial_resources: Mapping[str, LLM | PromptTemplate | Checkpoint | Any] | None = None
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
        """Train on `train_dataset` (GRPO: each step samples groups_per_step tasks, each run
        group_size times; APO: critiques on it); with `val_dataset`, the last version's mean
        reward on it (APO: the best template's, which it needs)."""
        if self.algorithm is None:
            raise FitError(
                "fit needs an algorithm: Trainer(algorithm=GRPO(...)) or APO(...); dev() runs none"
            )
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
        self._resources()  # bad settings stop here, before anything starts
        plan = self._plan(val_dataset) if train and role != "runner" else None
        kafka, database, stop_stack = self._connect()
        try:
            if role == "runner":
                return self._runners_only(spec, env, kafka)
            runners = 0 if role == "algorithm" else self.n_runners
            args = (spec, env, runners, kafka, database, train_dataset, val_dataset)
            if isinstance(plan, ApoPlan):
                return self._apo(plan, *args)
            if train:
                return self._grpo(*args)
            return self._dev(*args)
        finally:
            stop_stack()

    def _plan(self, val_dataset: Sequence[Any] | None) -> ApoPlan | None:
        """The APO run's plan (None: GRPO); FitError names a setting that cannot be used."""
        if isinstance(self.algorithm, GRPO):
            return None
        try:
            val_size = len(self._capped(val_dataset or []))
            return plan_apo(self.algorithm, self._resources(), val_size)
        except ValueError as exc:
            raise FitError(str(exc)) from None

    def _resources(self) -> dict[str, Resource]:
        """initial_resources as agl-stream's (Agent Lightning's APO: its own, as its Trainer
        sets them, when the Trainer has none)."""
        given = self.initial_resources
        algorithm: Any = self.algorithm  # Agent Lightning's, when from_agent_lightning says so
        if given is None and from_agent_lightning(algorithm):
            given = algorithm.get_initial_resources()
        try:
            return stream_resources(given or {})
        except ValueError as exc:
            raise FitError(str(exc)) from None

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
            resources=self._resources(), **more,
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
        assert isinstance(algo, GRPO)
        per_step = algo.group_size * algo.groups_per_step
        steps = algo.steps
        if self.max_rollouts is not None:
            steps = max(1, min(steps, self.max_rollouts // per_step))
        config = self._config(
            spec, env, runners, steps=steps, groups_per_step=algo.groups_per_step,
            group_size=algo.group_size, seed=algo.seed, learning_rate=algo.learning_rate,
            max_staleness=algo.max_staleness, task_source=DatasetSampler(train_dataset),
            timeout_seconds=algo.timeout_seconds, trainer_args=algo.trainer_args(),
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
                stalled = str(exc).startswith("no training step")
                raise FitError(f"{exc}{algo.stall_hint() if stalled else ''}") from None
        return result

    def _apo(
        self,
        plan: ApoPlan,
        spec: str,
        env: Mapping[str, str],
        runners: int,
        kafka: KafkaSettings,
        database: DatabaseSettings,
        train_dataset: Sequence[Any],
        val_dataset: Sequence[Any] | None,
    ) -> FitResult:
        """agl-stream's APO in this process; runners and a projector as processes. The
        initial resources go out first as the latest version, so that every candidate
        carries the other resources (the agent's LLM) along with its template."""
        config = self._config(spec, env, runners, algorithm=False)
        state_dir = config.out_dir / config.run_name / "apo"
        train, val = self._capped(train_dataset), self._capped(val_dataset or [])
        apo_config = plan.config(str(state_dir), self.run_name, train, val)
        result = FitResult(self.run_name, checkpoint_dir=state_dir)
        display = Display(f"fit {self.run_name}", plan.apo.rounds + 1, "APO rounds")
        best = ""  # the figure beside the bar: the best score so far

        def on_round(report: RoundReport) -> None:
            nonlocal best
            best = f"best {report.best.score or 0.0:.3f}"
            display.update(report.round + 1, best)
            point = _round_point(report, result.steps)
            result.steps.append(point)
            if self.on_step is not None:
                self.on_step(point)

        def on_progress(what: str, finished: int, total: int) -> None:
            display.update(len(result.steps), f"{best}  {what}: {finished}/{total}".strip())

        async def run(processes: Mapping[str, subprocess.Popen[bytes]]) -> ApoState:
            change = Change(self._resources(), f"{self.run_name}-initial", carry=False)
            await publish_resources(kafka, change, published_by="fit")
            apo = Apo(kafka, database, apo_config, on_round=on_round, on_progress=on_progress)
            return await _watched(apo.run(asyncio.Event()), processes, config.log_dir)

        with display, workers(config, kafka, database, 0) as processes:
            try:
                state = asyncio.run(run(processes))
            except ApoError as exc:
                raise FitError(str(exc)) from None
        winner = state.best()
        if winner is not None:
            result.val_reward = winner.score
            result.best_prompt = PromptTemplate(template=winner.template, engine=state.engine)
        result.resources_id = state.published[-1].resources_id if state.published else None
        if from_agent_lightning(self.algorithm):
            tell_agent_lightning(self.algorithm, state)
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
            resources = self._resources()
            if resources:
                resources_id = f"{self.run_name}-initial"
                change = Change(resources, resources_id, carry=False)
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
        """Wait for the rollouts to finish (as the read model tells it); their rows. PostgreSQL
        going away meanwhile is waited out (the workers go on without it)."""

        async def finished() -> dict[str, Any]:
            async with ReadModel.open(database) as model:
                while True:
                    check()
                    try:
                        await model.wait_for_rollouts(
                            ids, within=5.0, on_progress=lambda done, _: display.update(done)
                        )
                        return await model.rollouts_by_id(ids)
                    except TimeoutError:
                        continue

        return await riding_out(finished, "Trainer.fit")


async def _watched(
    work: Awaitable[T], processes: Mapping[str, subprocess.Popen[bytes]], log_dir: Path
) -> T:
    """`work`'s result; FitError when one of the processes stops first (`work` cancelled)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=1.0)
            if done:
                return task.result()
            raise_if_stopped(first_stopped(processes), log_dir, FitError)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _round_point(report: RoundReport, before: Sequence[StepPoint]) -> StepPoint:
    """An APO round as a step: the best score so far, the validation rollouts it measured,
    and the version that holds the best template (the one published, else the last)."""
    measured = sum(len(c.rewards or []) for c in report.candidates)
    published = report.published or (before[-1].resources_id if before else "")
    return StepPoint(report.round, report.best.score or 0.0, measured, published)


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
