"""Trainer.fit and Trainer.dev in Agent Lightning's shape, on the test's own topics and
database (configured through AGL_STREAM_* as a user's cluster would be): runner, projector,
trainer and policy-server processes, the agent handed over as an object."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agl_stream import GRPO, Trainer
from agl_stream.events import PromptTemplate
from agl_stream.launch.fit import FitError, agent_reference
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings
from agl_stream.training.checkpoints import CheckpointStore, lineage_problems
from tests.support import SUPPORT, fit_agents


@pytest.fixture
def configured(
    kafka: KafkaSettings, database: DatabaseSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGL_STREAM_BOOTSTRAP_SERVERS", kafka.bootstrap_servers)
    monkeypatch.setenv("AGL_STREAM_TOPIC_PREFIX", kafka.topic_prefix)
    monkeypatch.setenv("AGL_STREAM_REPLICATION_FACTOR", str(kafka.replication_factor))
    monkeypatch.setenv("AGL_STREAM_DATABASE_URL", database.database_url.get_secret_value())
    monkeypatch.delenv("AGL_CURRENT_ROLE", raising=False)


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
