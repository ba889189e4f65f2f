"""examples/agl_agent, both ways: Agent Lightning 0.3's Trainer (its runners, tracer and Baseline
algorithm) run unchanged on AglStreamStore, its records still there for a new store after the
script ended; and the same agent as a process agent under `worker --agent-command`. The LLM is
the tests' scripted rule-following endpoint (tests/apo_world.py)."""

from __future__ import annotations

import asyncio
import json
import sys
from asyncio.subprocess import PIPE, STDOUT
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from agl_stream.agl import AglStreamStore
from agl_stream.config import KafkaSettings, child_environment
from agl_stream.events import LLM, AttemptStatus, PromptTemplate
from tests import apo_world
from tests.integration.agl_fixtures import fresh_place
from tests.integration.backends import Backend
from tests.integration.runs import publish_resources, queue, wait_terminal
from tests.integration.test_agl_server import free_port

EXAMPLE = Path(__file__).parent.parent.parent / "examples" / "agl_agent"
TEMPLATE = "Cite a source. Answer the question: {question}"
TASKS = [json.loads(line) for line in (EXAMPLE / "tasks.jsonl").read_text().splitlines()]


def expected_reward(task: dict[str, object]) -> float:
    wants = task["wants"]
    assert isinstance(wants, list)
    return wants.count("cite") / len(wants)  # the template asks only to cite


@pytest.fixture(scope="module")
async def rules_llm() -> AsyncIterator[str]:
    runner = web.AppRunner(apo_world.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        await runner.cleanup()


async def test_agent_lightnings_trainer_runs_unchanged_and_its_records_outlive_it(
    embedded_backend: Backend, rules_llm: str, tmp_path: Path
) -> None:
    async with fresh_place(embedded_backend) as place:
        script = await asyncio.create_subprocess_exec(
            sys.executable, str(EXAMPLE / "train.py"), "--llm-endpoint", rules_llm,
            "--model", "rules", "--tasks", "4", "--runners", "2", "--template", TEMPLATE,
            env=child_environment(place.kafka, place.database), stdout=PIPE, stderr=STDOUT,
            cwd=tmp_path,  # Agent Lightning's AgentOps tracer writes agentops.log where it runs
        )  # fmt: skip
        output, _ = await asyncio.wait_for(script.communicate(), 240)
        assert script.returncode == 0, output.decode()[-4000:]

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
                assert find_final_reward(list(spans)) == expected_reward(rollout.input)
            workers = await store.query_workers()
            # Each runner asked for work under its worker id (its heartbeats may not have
            # come round yet in so short a run).
            assert len(workers) == 2 and all(w.last_dequeue_time for w in workers)
        finally:
            await store.aclose()


async def test_the_same_agent_as_a_process_agent(kafka: KafkaSettings, rules_llm: str) -> None:
    await publish_resources(
        kafka, "rules-v1", llm=LLM(endpoint=rules_llm, model="rules"),
        prompt_template=PromptTemplate(template=TEMPLATE),
    )  # fmt: skip
    ids = await queue(kafka, TASKS)
    runner = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agl_stream.cli.main", "worker", "--role", "runner",
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
