"""Agents the runner tests run (importable as tests.support.agents:NAME)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from opentelemetry import trace

from agl_stream.agent import LitAgent, NamedResources, Rollout, emit_message, emit_reward, rollout
from agl_stream.demo.task import ANSWER_WORDS, score
from agl_stream.events import Checkpoint
from agl_stream.training.local_llm import local_llm
from agl_stream.training.model import set_threads


@rollout
async def behave(task: dict[str, Any], rollout: Rollout) -> float | None:
    """Does what the task says: sleep, fail on some attempts, stall without spans, emit spans."""
    for i in range(int(task.get("spans", 2))):
        emit_message(f"step {i}", step=i)
        await asyncio.sleep(float(task.get("sleep", 0)) / max(int(task.get("spans", 2)), 1))
    if rollout.attempt_number in task.get("fail_on_attempts", []):
        raise ValueError(f"told to fail attempt {rollout.attempt_number}")
    if task.get("stall"):
        await asyncio.sleep(float(task["stall"]))
    if task.get("reject"):
        raise TypeError("this agent rejects the input")
    return float(task.get("reward", 1.0))


@rollout
def sync_agent(task: dict[str, Any]) -> None:
    emit_message("sync")
    time.sleep(float(task.get("sleep", 0)))
    emit_reward({"accuracy": 0.5, "length": 1.0}, primary="accuracy")


class Prompted(LitAgent):
    """Uses its resources: records which prompt template it was given."""

    def rollout(self, task: Any, resources: NamedResources, rollout: Rollout) -> float:
        template = resources.get("prompt")
        emit_message(getattr(template, "template", "none"), resources_id=rollout.resources_id or "")
        return 0.0


@rollout
def chaos_echo(task: dict[str, Any], policy: Checkpoint, rollout: Rollout) -> float:
    """The demo's in-process agent (samples the latest checkpoint), with a span of its own, a
    pause where a kill can interrupt it, and failures on the attempts the task names."""
    emit_message(f"asked to echo {task['letter']}", attempt=rollout.attempt_number)
    time.sleep(float(task.get("sleep", 0)))
    if rollout.attempt_number in task.get("fail_on_attempts", []):
        raise ValueError(f"told to fail attempt {rollout.attempt_number}")
    set_threads(1)
    answer = local_llm(policy).complete(
        f"<bos> {task['letter']}", max_new_tokens=ANSWER_WORDS, resources_id=rollout.resources_id
    )
    return score(task["letter"], answer.text)


HELD = threading.Event()  # a test sets it to let `held_echo`'s held rollouts go on


@rollout
def held_echo(task: dict[str, Any], policy: Checkpoint, rollout: Rollout) -> float:
    """The demo's in-process agent; a task with `hold` waits for HELD first (in the runner's
    thread for it), so that its rollout stays running, and its version live, until then."""
    if task.get("hold") and not HELD.wait(120):
        raise TimeoutError("the test never released the held rollout")
    set_threads(1)
    answer = local_llm(policy).complete(
        f"<bos> {task['letter']}", max_new_tokens=ANSWER_WORDS, resources_id=rollout.resources_id
    )
    return score(task["letter"], answer.text)


@rollout
def leaky(task: dict[str, Any]) -> float:
    """Puts an e-mail address and an API key in its spans (the runner's redaction removes
    them before the spans leave it)."""
    emit_message(f"mail {task['email']} with {task['key']}", api_key=task["key"], to=task["email"])
    return 1.0


@rollout
def two_policies_echo(
    task: dict[str, Any], speaker: Checkpoint, listener: Checkpoint, rollout: Rollout
) -> float:
    """Two policies in one attempt: the speaker echoes the letter, the listener echoes what
    the speaker said; the reward (shared) scores the listener's answer. Each call is made
    inside its agent's span (`agent.name`, as the OpenAI Agents SDK records it), and a third
    agent, a judge, calls the listener's policy too (an agent whose calls are not trained:
    `worker trainer --agent-match`)."""
    set_threads(1)
    rid = rollout.resources_id
    agents = trace.get_tracer(__name__)
    with agents.start_as_current_span("agent", attributes={"agent.name": "speaker"}):
        said = local_llm(speaker).complete(
            f"<bos> {task['letter']}", max_new_tokens=1, resources_id=rid, policy="speaker"
        )
    with agents.start_as_current_span("agent", attributes={"agent.name": "listener"}):
        heard = local_llm(listener).complete(
            f"<bos> {said.text}", max_new_tokens=ANSWER_WORDS, resources_id=rid, policy="listener"
        )
    with agents.start_as_current_span("agent", attributes={"agent.name": "judge"}):
        local_llm(listener).complete(
            f"<bos> {heard.text}", max_new_tokens=1, resources_id=rid, policy="listener"
        )
    return score(task["letter"], heard.text)
