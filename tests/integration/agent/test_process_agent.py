"""Process agents through the real broker: a JavaScript agent and a shell agent (no
agl-stream code in either) run one process per attempt, call the LLM through the runner's
gateway with their key, post events and rewards, and their exit, timeout and output become the
attempt's status and spans."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
from asyncio.subprocess import PIPE, STDOUT
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agl_stream.agent.process import OUTPUT_LIMIT, PROCESS_SPAN, ProcessAgent
from agl_stream.events import LLM, AttemptStatus, SpanRecorded
from agl_stream.runtime.config import KafkaSettings, child_environment
from agl_stream.serving.engine import Loaded
from agl_stream.serving.server import PolicyServer
from agl_stream.training.model import tiny_chat_policy
from tests.support import ROOT, SUPPORT
from tests.support.helpers import eventually
from tests.support.runs import (
    history,
    publish_resources,
    queue,
    runner_in_process,
    wait_terminal,
)

AGENTS = SUPPORT / "process_agents"
EXAMPLE = ROOT / "examples" / "process_agent"


@pytest.fixture
async def policy_llm(kafka: KafkaSettings) -> AsyncIterator[str]:
    """A real (tiny) policy server, published as the attempts' `llm` resource."""
    server = PolicyServer()
    server.load(Loaded(tiny_chat_policy(seed=5), "tiny-v1"))
    url = await server.start("127.0.0.1", 0)
    await publish_resources(kafka, "tiny-v1", llm=LLM(endpoint=f"{url}/v1", model="tiny"))
    try:
        yield url
    finally:
        await server.stop()


def process_span(spans: list[SpanRecorded]) -> SpanRecorded:
    (span,) = [s for s in spans if s.name == PROCESS_SPAN]
    return span


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js")
async def test_a_javascript_agent_calls_the_llm_and_posts_its_reward(
    kafka: KafkaSettings, policy_llm: str
) -> None:
    tasks = [{"question": "What is 2 + 2?", "reward": r} for r in (0.25, 0.75)]
    ids = await queue(kafka, tasks)
    agent = ProcessAgent(["node", str(AGENTS / "probe.mjs")])
    async with runner_in_process(kafka, agent, concurrency=2):
        h = await wait_terminal(kafka, ids, 90)
    for rollout_id, task in zip(ids, tasks, strict=True):
        (finished,) = h.finished[rollout_id]
        assert finished.status is AttemptStatus.SUCCEEDED, finished.error
        assert finished.reward == task["reward"]  # posted to its event URL
        spans = h.spans[finished.attempt_id]
        assert sorted(s.sequence for s in spans) == list(range(finished.span_count))
        report = json.loads(str(process_span(spans).attributes["agl.process.stdout"]))
        assert report == {
            "stdin_is_the_task": True,
            "llm": 200,
            "answered": True,
            "llm_without_key": 401,
            "event_without_key": 401,
            "bad_event": 400,
            "events": 200,
        }
        names = [s.name for s in spans]
        assert names.count("agl.llm.call") == 1  # the refused call was not forwarded
        assert "agl.message" in names
        assert "agl.reward" in names
        # The events and the call sit in the attempt's trace, under the attempt's span.
        attempt = next(s for s in spans if s.name == "agl.attempt")
        for span in spans:
            if span.name in ("agl.llm.call", "agl.message", "agl.reward"):
                assert (span.trace_id, span.parent_span_id) == (attempt.trace_id, attempt.span_id)


async def test_exit_status_timeout_and_output_become_the_attempt(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    child_pid_file = tmp_path / "child.pid"
    agent = ProcessAgent(
        [str(AGENTS / "shell_agent.sh")], env={"CHILD_PID_FILE": str(child_pid_file)}
    )
    noise = OUTPUT_LIMIT * 3
    failing, loud, rewarded = await queue(kafka, ["exit 3", f"noise {noise}", "reward 0.5"])
    (sleeper,) = await queue(kafka, ["sleep"], timeout_seconds=3.0)
    async with runner_in_process(kafka, agent, concurrency=4):
        h = await wait_terminal(kafka, [failing, loud, rewarded, sleeper], 90)

    (finished,) = h.finished[failing]
    assert finished.status is AttemptStatus.FAILED
    assert finished.error is not None
    assert "exited with status 3" in finished.error.message
    assert "failing on purpose" in finished.error.message  # the end of its stderr

    (finished,) = h.finished[loud]
    assert finished.status is AttemptStatus.SUCCEEDED, finished.error
    assert finished.reward == 1.0
    span = process_span(h.spans[finished.attempt_id])
    assert span.attributes["agl.process.stdout_bytes"] == noise
    assert span.attributes["agl.process.stdout"] == "x" * OUTPUT_LIMIT  # its end, bounded

    (finished,) = h.finished[rewarded]
    assert (finished.status, finished.reward) == (AttemptStatus.SUCCEEDED, 0.5)

    # Past its timeout the whole process group is stopped: the agent and the child it left.
    (finished,) = h.finished[sleeper]
    assert finished.status is AttemptStatus.TIMEOUT
    child = int(child_pid_file.read_text())

    async def child_gone() -> bool:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True
        return _is_zombie(child)

    await eventually(child_gone, 10, "the agent's child process to be stopped")


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js")
async def test_the_example_runs_under_the_cli(kafka: KafkaSettings, policy_llm: str) -> None:
    """examples/process_agent as its README runs it: `enqueue` its tasks, then `worker --role
    runner --agent-command "node examples/process_agent/agent.mjs"` (a real process)."""
    env = child_environment(kafka)
    cli = [sys.executable, "-m", "agl_stream.cli.main"]
    enqueue = await asyncio.create_subprocess_exec(
        *cli, "enqueue", str(EXAMPLE / "tasks.jsonl"), env=env, stdout=PIPE, stderr=STDOUT
    )
    output, _ = await enqueue.communicate()
    assert enqueue.returncode == 0, output.decode()
    ids = list((await history(kafka, with_spans=False)).queued)
    assert len(ids) == 3
    runner = await asyncio.create_subprocess_exec(
        *cli, "worker", "runner", "--agent-command", f"node {EXAMPLE / 'agent.mjs'}",
        "--session-timeout-ms", "6000", "--heartbeat", "1", "--grace", "5",
        env=env, stdout=PIPE, stderr=STDOUT,
    )  # fmt: skip
    try:
        h = await wait_terminal(kafka, ids, 90)
    finally:
        runner.send_signal(signal.SIGTERM)
        output, _ = await asyncio.wait_for(runner.communicate(), 60)
    assert runner.returncode == 0, output.decode()
    for rollout_id in ids:
        (finished,) = h.finished[rollout_id]
        assert finished.status is AttemptStatus.SUCCEEDED, finished.error
        assert finished.reward in (0.0, 1.0)
        spans = h.spans[finished.attempt_id]
        assert [s.name for s in spans].count("agl.llm.call") == 1
        stdout = str(process_span(spans).attributes["agl.process.stdout"])
        assert f"(reward {finished.reward:g})" in stdout
