"""APO through Trainer.fit, as an Agent Lightning user writes it (`agl.APO(client, ...)`,
`agl.PromptTemplate` in initial_resources): agl-stream's APO runs in the script, a runner and a
projector as processes, on the test's own topics and database. The LLM, the agent's and the
optimizer's, is the tests' scripted rule-following endpoint (tests/support/apo_world.py):
which rewrite is better is only known by measuring it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections import Counter
from pathlib import Path

import openai
import pytest

import agl_stream.compat.agl  # noqa: F401  (first: it imports Agent Lightning quietly)
from agl_stream import APO, Trainer
from agl_stream.commands.resources import read_resources
from agl_stream.events import LLM, PromptTemplate
from agl_stream.launch.fit import FitError
from agl_stream.launch.run import StepPoint
from agl_stream.runtime.config import KafkaSettings
from agl_stream.training.apo.optimizer import read_state
from tests.support import apo_world

import agentlightning as agl  # isort: skip  (after agl_stream.compat.agl)

TRAIN = apo_world.tasks(12, seed=1)
VAL = apo_world.tasks(10, seed=2)


@pytest.mark.slow
@pytest.mark.usefixtures("configured")
def test_fit_runs_agent_lightnings_apo_and_publishes_the_best_template(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    steps: list[StepPoint] = []
    with apo_world.serving_in_thread() as (endpoint, app):
        algorithm = agl.APO(
            openai.AsyncOpenAI(base_url=endpoint, api_key="unused"),
            gradient_model="critic", apply_edit_model="editor", gradient_batch_size=6,
            val_batch_size=len(VAL), beam_width=2, branch_factor=3, beam_rounds=2,
            rollout_batch_timeout=120.0,
        )  # fmt: skip
        trainer = Trainer(
            algorithm=algorithm, n_runners=1, out_dir=tmp_path, on_step=steps.append,
            initial_resources={
                "prompt": agl.PromptTemplate(template=apo_world.SEED_TEMPLATE, engine="f-string"),
                "llm": agl.LLM(endpoint=endpoint, model="rules"),
            },
        )  # fmt: skip
        result = trainer.fit(apo_world.follow_rules, train_dataset=TRAIN, val_dataset=VAL)

    # One point per round, the seed's first: the best measured score rose each round.
    assert [p.step for p in result.steps] == [0, 1, 2]
    assert steps == result.steps
    scores = [p.mean_reward for p in result.steps]
    assert scores[0] == 0.0  # the seed asks for nothing the tasks want
    assert scores[0] < scores[1] < scores[2]
    assert all(p.samples > 0 for p in result.steps)  # validation rollouts measured
    assert result.val_reward == scores[-1]
    best = result.best_prompt
    assert best is not None
    assert best.template.endswith(apo_world.SEED_TEMPLATE)
    assert "Cite a source." in best.template  # the most wanted rule
    # Agent Lightning's APO answers as after its own Trainer's fit.
    assert algorithm.get_best_prompt().template == best.template
    assert algorithm.get_best_prompt().engine == "f-string"

    # The best is the latest version, the agent's LLM carried along with it.
    latest = asyncio.run(read_resources(kafka)).latest
    assert latest is not None
    assert latest.resources_id == result.resources_id == result.steps[-1].resources_id
    assert latest.resources["prompt"] == PromptTemplate(template=best.template)
    assert latest.resources["llm"] == LLM(endpoint=endpoint, model="rules")

    # Critiques were asked of gradient_model, rewrites of apply_edit_model.
    models = Counter(app[apo_world.MODELS])
    assert {model for call, model in models if call == "You review t"} == {"critic"}
    assert {model for call, model in models if call == "You improve "} == {"editor"}
    assert sum(n for (call, _), n in models.items() if call == "You review t") == 1 + 2
    # The rewrite that dropped the placeholder was refused, not measured.
    assert result.checkpoint_dir is not None
    state = read_state(str(result.checkpoint_dir))
    assert state is not None
    rejected = [c for c in state.candidates.values() if c.rejected]
    assert rejected and all(c.score is None for c in rejected)
    measured = [c for c in state.candidates.values() if c.rewards is not None]
    assert {len(c.rewards or []) for c in measured} == {len(VAL)}


@pytest.mark.usefixtures("configured")
def test_a_runner_that_dies_stops_an_apo_fit_with_a_sentence(tmp_path: Path) -> None:
    """agl-stream's own APO(...): killed after round 0, the runner takes the run down with it,
    which says where its log is; the state so far stays for a resumed run."""
    before = _children()

    def kill_the_runner(point: StepPoint) -> None:
        for pid in _children() - before:
            with contextlib.suppress(OSError):  # gone already
                if b"runner" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)

    with apo_world.serving_in_thread() as (endpoint, _):
        trainer = Trainer(
            algorithm=APO(rounds=2, train_batch=4, optimizer_endpoint=endpoint,
                          optimizer_model="rules", timeout_seconds=60),
            n_runners=1, out_dir=tmp_path, on_step=kill_the_runner,
            initial_resources={"prompt": PromptTemplate(template=apo_world.SEED_TEMPLATE),
                               "llm": LLM(endpoint=endpoint, model="rules")},
        )  # fmt: skip
        with pytest.raises(FitError, match=r"the runner-0 process stopped; its log is in "):
            trainer.fit(apo_world.follow_rules, train_dataset=TRAIN, val_dataset=VAL[:4])
    assert _children() <= before  # the projector stopped too
    state = read_state(str(tmp_path / trainer.run_name / "apo"))
    assert state is not None
    assert state.round == 1  # the seed was measured


def _children() -> set[int]:
    """This process's children (from /proc: the parent is the 4th field of stat)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[1]) == os.getpid():
            found.add(int(stat.parent.name))
    return found
