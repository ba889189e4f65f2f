"""Trainer.fit and Trainer.dev in Agent Lightning's shape, on the test's own topics and
database (configured through AGL_STREAM_* as a user's cluster would be): runner, projector,
trainer and policy-server processes, the agent handed over as an object."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from aiokafka import TopicPartition

from agl_stream import GRPO, Trainer
from agl_stream.bus.kafka import consumer, end_offsets
from agl_stream.bus.streams import EventStream, Topics
from agl_stream.commands.rewards import RewardSender
from agl_stream.events import (
    AttemptFinished,
    AttemptStatus,
    PromptTemplate,
    RolloutMode,
    RolloutQueued,
)
from agl_stream.launch.fit import FitError, agent_reference
from agl_stream.runtime.config import KafkaSettings
from agl_stream.training.checkpoints import CheckpointStore, lineage_problems
from agl_stream.training.trajectories import LateRewardRule, MissingLateReward
from tests.support import SUPPORT, fit_agents

SUCCEEDED = AttemptStatus.SUCCEEDED


@pytest.mark.slow
@pytest.mark.usefixtures("configured")
def test_fit_trains_with_grpo_and_validates_the_last_version(tmp_path: Path) -> None:
    algorithm = GRPO(steps=2, group_size=4, groups_per_step=2)
    trainer = Trainer(algorithm=algorithm, n_runners=1, out_dir=tmp_path)
    tasks = [{"letter": letter} for letter in "abcde"]
    result = trainer.fit(fit_agents.letter, train_dataset=tasks, val_dataset=tasks[:3])
    assert [p.step for p in result.steps] == [1, 2]
    assert all(p.samples == 8 for p in result.steps)
    assert all(p.resources_id.startswith(f"{trainer.run_name}-v") for p in result.steps)
    assert result.val_reward is not None
    assert 0.0 <= result.val_reward <= 1.0
    assert result.checkpoint_dir is not None
    assert lineage_problems(CheckpointStore(str(result.checkpoint_dir)).lineage()) == []


@contextmanager
def feedback(kafka: KafkaSettings, too_late: float) -> Iterator[list[tuple[str, str, float]]]:
    """A user's feedback, from outside the attempts, on a thread of its own (fit runs its own
    event loop): to each train rollout of task "a" that succeeds it gives reward "thumbs" at
    once, 1.0 and 0.0 in turn; to those of "b", 1.0 only `too_late` seconds after they ended.
    What it gave: (rollout id, letter, value)."""
    given: list[tuple[str, str, float]] = []
    failures: list[BaseException] = []
    ready, stop = threading.Event(), threading.Event()

    async def follow() -> None:
        topics = Topics(kafka)
        tps = [
            TopicPartition(topics.name(topic), p)
            for topic in ("tasks", "rollouts")
            for p in range(topics.specs[topic].partitions)
        ]
        ends = await end_offsets(kafka, tps)
        letters: dict[str, str] = {}
        ended: dict[str, AttemptFinished] = {}  # succeeded, their task not read yet
        answered: set[str] = set()
        later: list[asyncio.Task[None]] = []
        async with consumer(kafka) as reader, RewardSender(kafka) as rewards:

            async def give(event: AttemptFinished, letter: str, value: float, after: float) -> None:
                await asyncio.sleep(after)
                await rewards.send(
                    event.rollout_id, value, name="thumbs", attempt_id=event.attempt_id
                )
                given.append((event.rollout_id, letter, value))

            reader.assign(tps)
            for tp in tps:
                reader.seek(tp, ends[tp])
            stream = EventStream(reader, None, topics, "test-feedback")
            ready.set()
            while not stop.is_set():
                for item in await stream.next_batch(timeout_ms=200):
                    event = item.event
                    if isinstance(event, RolloutQueued) and event.mode is RolloutMode.TRAIN:
                        letters[event.rollout_id] = json.loads(event.input_json)["letter"]
                    elif isinstance(event, AttemptFinished) and event.status is SUCCEEDED:
                        ended[event.rollout_id] = event
                for rollout_id in [r for r in ended if r in letters and r not in answered]:
                    answered.add(rollout_id)
                    event, letter = ended.pop(rollout_id), letters[rollout_id]
                    if letter == "a":
                        turn = sum(1 for _, seen, _ in given if seen == "a")
                        await give(event, letter, float(turn % 2 == 0), 0.0)
                    else:
                        later.append(asyncio.create_task(give(event, letter, 1.0, too_late)))
            for task in later:
                task.cancel()
            await asyncio.gather(*later, return_exceptions=True)

    def run() -> None:
        try:
            asyncio.run(follow())
        except BaseException as exc:  # noqa: BLE001  (reported by the test)
            failures.append(exc)
            ready.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(60), "the feedback thread did not start"
    try:
        yield given
    finally:
        stop.set()
        thread.join(30)
        assert failures == [], failures


@pytest.mark.slow
@pytest.mark.usefixtures("configured")
def test_fit_trains_on_late_rewards_by_the_trainers_rule(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    """fit's trainer applies `worker trainer --late-reward`'s rule: an attempt waits for its
    reward "thumbs" up to the window, trains on it when it comes; one whose reward comes only
    after the window (after it was trained on) falls back to its own reward, 0."""
    rule = LateRewardRule("thumbs", wait_seconds=8, missing=MissingLateReward.FINAL)
    algorithm = GRPO(steps=2, group_size=4, groups_per_step=2, late_reward=rule)
    trainer = Trainer(algorithm=algorithm, n_runners=1, out_dir=tmp_path)
    tasks = [{"letter": "a"}, {"letter": "b"}]
    with feedback(kafka, too_late=rule.wait_seconds + 4) as given:
        result = trainer.fit(fit_agents.unrewarded_letter, train_dataset=tasks)
    assert [p.step for p in result.steps] == [1, 2]
    assert [p.mean_reward for p in result.steps] == pytest.approx([0.25, 0.25])
    assert result.checkpoint_dir is not None
    states = [s for s in CheckpointStore(str(result.checkpoint_dir)).lineage() if s["step"] > 0]
    for state in states:
        counts = state["counts"]
        assert (counts.get("late_reward_late"), counts.get("late_reward_fallback")) == (4, 4)
        assert sorted(state["rewards"]) == [0.0] * 6 + [1.0] * 2
    assert lineage_problems(states) == []
    assert sum(1 for _, letter, _ in given if letter == "a") == 8


@pytest.mark.usefixtures("configured")
def test_dev_runs_each_task_once_on_the_initial_resources(tmp_path: Path) -> None:
    trainer = Trainer(
        n_runners=1, max_rollouts=3, out_dir=tmp_path,
        initial_resources={"prompt": PromptTemplate(template="hello {name}")},
    )  # fmt: skip
    tasks = [
        {"name": "ada", "expected": "hello ada"},
        {"name": "bo", "expected": "goodbye bo"},
        {"name": "cy", "expected": "hello cy"},
        {"name": "di", "expected": "hello di"},  # past max_rollouts
    ]
    result = trainer.dev(fit_agents.greeter, train_dataset=tasks, val_dataset=tasks[:2])
    assert sorted(result.rewards.values()) == [0.0, 1.0, 1.0]  # type: ignore[type-var]
    assert set(result.statuses.values()) == {"succeeded"}
    assert result.val_reward == 0.5


def test_agents_are_found_by_name_for_the_runner_processes() -> None:
    spec, env = agent_reference(fit_agents.greeter)
    assert spec == "tests.support.fit_agents:greeter"
    assert "AGL_STREAM_FIT_CHILD" in env
    assert agent_reference(fit_agents.letter)[0] == "tests.support.fit_agents:letter"
    with pytest.raises(FitError, match="cannot find the agent"):
        agent_reference(lambda task: 1.0)


def test_fit_refuses_what_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FitError, match=r"fit needs an algorithm"):
        Trainer().fit(fit_agents.greeter, train_dataset=[{}])
    with pytest.raises(ValueError, match="GRPO group_size must be at least 1"):
        GRPO(group_size=0)
    monkeypatch.setenv("AGL_CURRENT_ROLE", "projector")
    with pytest.raises(FitError, match=r"AGL_CURRENT_ROLE=.projector.: Trainer.fit takes both"):
        Trainer().dev(fit_agents.greeter, train_dataset=[{}])
    monkeypatch.setenv("AGL_STREAM_FIT_CHILD", "1")
    with pytest.raises(FitError, match='under `if __name__ == "__main__":`'):
        Trainer().dev(fit_agents.greeter, train_dataset=[{}])


def _ctrl_c_as_in_a_terminal() -> None:
    """A terminal's foreground job starts with Ctrl-C at its default; pytest run as a
    background job (CI's may be) has it ignored, and the script would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.usefixtures("configured")
def test_ctrl_c_stops_the_script_and_every_process_it_started(tmp_path: Path) -> None:
    """A script with its agent in itself (runners import it by file), stopped by Ctrl-C as
    a terminal sends it: to the whole foreground process group."""
    script = subprocess.Popen(
        [sys.executable, str(SUPPORT / "fit_script.py"), str(tmp_path)],
        start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        preexec_fn=_ctrl_c_as_in_a_terminal,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not list(tmp_path.glob("*/checkpoints/step-*")):  # it trains
            assert script.poll() is None, script.communicate()[0].decode()[-3000:]
            assert time.monotonic() < deadline, "no training step in 180 s"
            time.sleep(0.5)
        started = descendants(script.pid)
        assert len(started) >= 4  # policy server, trainer, projector, runner
        os.killpg(script.pid, signal.SIGINT)
        output = script.communicate(timeout=90)[0].decode()
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
    assert "KeyboardInterrupt" in output, output
    alive = [pid for pid in started if Path(f"/proc/{pid}").exists()]
    assert alive == [], output[-3000:]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc: the parent is the 4th field of stat)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


@pytest.mark.usefixtures("configured")
def test_an_algorithm_that_crashes_stops_the_run_with_a_sentence(tmp_path: Path) -> None:
    before = set(descendants(os.getpid()))
    trainer = Trainer(algorithm=GRPO(steps=2, learning_rate=-1.0), n_runners=1, out_dir=tmp_path)
    with pytest.raises(FitError, match=r"the trainer process stopped; its log is in"):
        trainer.fit(fit_agents.letter, train_dataset=[{"letter": "a"}])
    assert set(descendants(os.getpid())) <= before  # runner, projector, server: stopped
