"""examples/agl_agent, both ways: Agent Lightning 0.3's Trainer (its runner processes, tracer, and
its APO or Baseline algorithm) run unchanged on AglStreamStore, its records, each rollout's LLM
call among its spans, still there for a new store after the script ended; and the same agent as
a process agent under `worker --agent-command`.
The LLM, the agent's and APO's, is the tests' scripted rule-following endpoint
(tests/support/apo_world.py)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import statistics
import sys
from asyncio.subprocess import PIPE, STDOUT
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agl_stream.compat.agl import AglStreamStore
from agl_stream.events import LLM, AttemptStatus, PromptTemplate
from agl_stream.runtime.config import KafkaSettings, child_environment
from tests.support import ROOT, apo_world
from tests.support.agl_fixtures import (
    Endpoint,
    Place,
    fresh_place,
    rules_llm_endpoint,
    run_script,
)
from tests.support.backends import Backend
from tests.support.runs import publish_resources, queue, wait_terminal

EXAMPLE = ROOT / "examples" / "agl_agent"
TEMPLATE = "Cite a source. Answer the question: {question}"
TASKS = [json.loads(line) for line in (EXAMPLE / "tasks.jsonl").read_text().splitlines()]
LLM_CALL = "openai.chat.completion"  # the span of the agent's LLM call (AgentOps' name)


def example_tasks(count: int) -> list[dict[str, Any]]:
    """The tasks train.py makes (agent.py's `tasks`)."""
    spec = importlib.util.spec_from_file_location("agl_example_agent", EXAMPLE / "agent.py")
    assert spec is not None and spec.loader is not None
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    tasks: list[dict[str, Any]] = agent.tasks(count)
    return tasks


APO_TASKS = example_tasks(8)  # 4 to critique, 4 to validate


def reward_of(template: str, task: dict[str, Any]) -> float:
    """The reward the rule-following model earns on `task` with `template`: the share of the
    rules the task wants that the template states."""
    wants = task["wants"]
    return sum(apo_world.RULES[w] in template for w in wants) / len(wants)


def expected_reward(task: dict[str, object]) -> float:
    return reward_of(TEMPLATE, task)  # the template asks only to cite


@pytest.fixture(scope="module")
async def rules_llm() -> AsyncIterator[Endpoint]:
    async with rules_llm_endpoint({t["question"]: t["wants"] for t in APO_TASKS}) as endpoint:
        yield endpoint


async def train(place: Place, cwd: Path, *args: str) -> str:
    """Run examples/agl_agent/train.py to its end; what it printed."""
    env = child_environment(place.kafka, place.database)
    code, output = await run_script(str(EXAMPLE / "train.py"), *args, env=env, cwd=cwd, seconds=240)
    assert code == 0, output[-4000:]
    return output


async def test_agent_lightnings_apo_runs_unchanged_and_publishes_a_better_template(
    embedded_backend: Backend, rules_llm: Endpoint, tmp_path: Path
) -> None:
    calls_before = len(rules_llm.app[apo_world.CALLS])
    async with fresh_place(embedded_backend) as place:
        output = await train(
            place, tmp_path, "--algorithm", "apo", "--llm-endpoint", rules_llm.url,
            "--model", "rules", "--optimizer-model", "rules", "--tasks", str(len(APO_TASKS)),
            "--rounds", "1", "--beam-width", "1", "--branch-factor", "2",
        )  # fmt: skip

        from agentlightning.reward import find_final_reward

        store = AglStreamStore(place.kafka, place.database)  # a new process's view
        try:
            best = await store.get_resources_by_id("apo-best")
            latest = await store.get_latest_resources()
            assert best is not None and latest is not None and latest.resources_id == "apo-best"
            template = best.resources["prompt_template"].template
            assert template in output
            assert "{question}" in template
            assert any(rule in template for rule in apo_world.RULES.values()), template

            # Every template APO tried, with the validation reward its rollouts earned.
            val_rewards: dict[str, list[float]] = {}
            rollouts = await store.query_rollouts()
            for rollout in rollouts:
                assert rollout.status == "succeeded", rollout
                attempts = await store.query_attempts(rollout.rollout_id)
                assert [a.status for a in attempts] == ["succeeded"], attempts
                spans = await store.query_spans(rollout.rollout_id)
                assert spans and [s.sequence_id for s in spans] == sorted(
                    s.sequence_id for s in spans
                )
                assert LLM_CALL in [s.name for s in spans]  # what APO's critique reads
                reward = find_final_reward(list(spans))
                resources = await store.get_resources_by_id(rollout.resources_id or "")
                assert resources is not None
                tried = resources.resources["prompt_template"].template
                assert reward == reward_of(tried, rollout.input)  # the scripted model's reward
                if rollout.mode == "val":
                    val_rewards.setdefault(tried, []).append(reward)
            modes = [r.mode for r in rollouts]
            # 4 training tasks per rewrite; the validation tasks for the seed (before and
            # after the round's measuring) and each rewrite, and for the round's leader.
            assert modes.count("train") == 2 * 4 and modes.count("val") == (1 + 3 + 1) * 4
        finally:
            await store.aclose()

    seed = statistics.mean(val_rewards[apo_world.SEED_TEMPLATE])
    better = statistics.mean(val_rewards[template])
    assert better > seed, val_rewards
    assert better == max(statistics.mean(r) for r in val_rewards.values())
    calls = rules_llm.app[apo_world.CALLS][calls_before:]
    assert calls.count("agl-critique") == calls.count("agl-edit") == 2, calls
    print(f"APO on the validation tasks: seed {seed:.3f}, best {better:.3f} ({template!r})")


async def test_agent_lightnings_baseline_runs_unchanged_and_its_records_outlive_it(
    embedded_backend: Backend, rules_llm: Endpoint, tmp_path: Path
) -> None:
    async with fresh_place(embedded_backend) as place:
        await train(
            place, tmp_path, "--algorithm", "baseline", "--llm-endpoint", rules_llm.url,
            "--model", "rules", "--tasks", "4", "--runners", "2", "--template", TEMPLATE,
        )  # fmt: skip

        from agentlightning.reward import find_final_reward

        store = AglStreamStore(place.kafka, place.database)  # a new process's view
        try:
            rollouts = await store.query_rollouts(sort_by="start_time")
            assert len(rollouts) == 4
            assert [r.mode for r in rollouts] == ["train", "train", "val", "val"]
            resources = await store.get_resources_by_id("default")
            assert (
                resources is not None
                and resources.resources["prompt_template"].template == TEMPLATE
            )
            for rollout in rollouts:
                assert rollout.status == "succeeded", rollout
                assert rollout.resources_id == "default"
                spans = await store.query_spans(rollout.rollout_id)
                assert spans and [s.sequence_id for s in spans] == sorted(
                    s.sequence_id for s in spans
                )
                assert LLM_CALL in [s.name for s in spans]
                assert find_final_reward(list(spans)) == expected_reward(rollout.input)
            workers = await store.query_workers()
            # Each runner asked for work under its worker id (its heartbeats may not have
            # come round yet in so short a run).
            assert len(workers) == 2 and all(w.last_dequeue_time for w in workers)
        finally:
            await store.aclose()


async def test_the_same_agent_as_a_process_agent(kafka: KafkaSettings, rules_llm: Endpoint) -> None:
    await publish_resources(
        kafka, "rules-v1", llm=LLM(endpoint=rules_llm.url, model="rules"),
        prompt_template=PromptTemplate(template=TEMPLATE),
    )  # fmt: skip
    ids = await queue(kafka, TASKS)
    runner = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agl_stream.cli.main", "worker", "runner",
        "--agent-command", f"{sys.executable} {EXAMPLE / 'process_agent.py'}",
        "--session-timeout-ms", "6000", "--heartbeat", "1", "--grace", "5",
        env=child_environment(kafka), stdout=PIPE, stderr=STDOUT,
    )  # fmt: skip
    try:
        history = await wait_terminal(kafka, ids, 90)
    finally:
        runner.terminate()
        output, _ = await asyncio.wait_for(runner.communicate(), 60)
    assert runner.returncode == 0, output.decode()[-4000:]
    for rollout_id, task in zip(ids, TASKS, strict=True):
        (finished,) = history.finished[rollout_id]
        assert finished.status is AttemptStatus.SUCCEEDED, finished.error
        assert finished.reward == expected_reward(task)
