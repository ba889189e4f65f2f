"""The agent API: argument binding, loading by name, emitters, span conversion."""

from __future__ import annotations

import asyncio

import pytest

from agl_stream.agent import LitAgent, Rollout, emit_reward, rollout
from agl_stream.agent.api import FunctionAgent, load_agent
from agl_stream.agent.spans import flatten
from agl_stream.agent.tracing import AttemptRecorder, current_recorder, tracer
from agl_stream.events import LLM, PromptTemplate, RolloutMode, SpanRecorded

ROLLOUT = Rollout("ro", "at", 1, RolloutMode.TRAIN, "res-1")
RESOURCES = {"main": LLM(endpoint="http://x/v1", model="m"), "prompt": PromptTemplate(template="t")}


def test_function_agents_get_what_their_parameters_ask_for() -> None:
    seen = {}

    @rollout
    def agent(
        task: int, llm: LLM, prompt: PromptTemplate, rollout: Rollout, resources: dict
    ) -> float:  # type: ignore[type-arg]
        seen.update(task=task, llm=llm, prompt=prompt, rollout=rollout, resources=resources)
        return 1.0

    assert asyncio.run(agent.rollout_async(7, RESOURCES, ROLLOUT)) == 1.0
    assert seen["llm"] is RESOURCES["main"]  # by type: the only LLM
    assert seen["prompt"] is RESOURCES["prompt"]  # by name
    assert seen["rollout"] is ROLLOUT and seen["task"] == 7


def test_a_missing_resource_is_a_clear_error() -> None:
    @rollout
    async def agent(task: int, checkpoint: object) -> None: ...

    with pytest.raises(TypeError, match="no resource for parameter 'checkpoint'"):
        asyncio.run(agent.rollout_async(1, RESOURCES, ROLLOUT))


def test_load_agent_by_name() -> None:
    assert isinstance(load_agent("tests.support.agents:behave"), FunctionAgent)
    assert isinstance(load_agent("tests.support.agents:Prompted"), LitAgent)
    with pytest.raises(ValueError, match="must look like"):
        load_agent("no_colon")
    with pytest.raises(ValueError, match="cannot import"):
        load_agent("no.such.module:x")
    with pytest.raises(ValueError, match="has no attribute"):
        load_agent("tests.support.agents:nope")


def test_flatten_nested_attributes() -> None:
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": [{"e": "x"}], "f": object}) == {
        "a.b": 1, "a.c": [1, 2], "d.0.e": "x", "f": str(object),
    }  # fmt: skip


def test_reward_dimensions_need_a_primary() -> None:
    with pytest.raises(ValueError, match="say which is primary"):
        emit_reward({"a": 1.0, "b": 2.0})
    with pytest.raises(ValueError, match="finite"):
        emit_reward(float("nan"))


def test_spans_of_an_attempt_are_numbered_and_late_ones_dropped() -> None:
    recorder = AttemptRecorder("ro", "at")

    async def attempt() -> None:
        current_recorder.set(recorder)
        with tracer().start_as_current_span("agl.attempt"):
            emit_reward(0.5)

    asyncio.run(attempt())
    assert recorder.reward == 0.5
    assert [(e.sequence, e.name) for e in recorder.take(0)] == [
        (0, "agl.reward"),
        (1, "agl.attempt"),
    ]
    assert recorder.close() == 2
    for event in recorder.take(0):  # built without validation: must validate all the same
        assert SpanRecorded.model_validate(event.model_dump()) == event

    async def late() -> None:
        current_recorder.set(recorder)
        emit_reward(1.0)

    asyncio.run(late())
    assert len(recorder.take(0)) == 2


def test_a_reward_for_one_policy_is_not_the_attempts() -> None:
    recorder = AttemptRecorder("ro", "at")

    async def attempt() -> None:
        current_recorder.set(recorder)
        emit_reward(0.5)
        emit_reward(0.25, policy="speaker")  # the speaker's alone

    asyncio.run(attempt())
    assert recorder.reward == 0.5
    spans = recorder.take(0)
    assert [s.attributes.get("agl.reward.policy") for s in spans] == [None, "speaker"]
    assert spans[1].attributes["agl.reward"] == 0.25


def test_trained_agents_is_kept_and_says_the_trainer_chooses() -> None:
    """Agent Lightning's LitAgent(trained_agents=...): a moved agent still runs; the warning
    names the trainer's option that does it here."""

    class Writer(LitAgent):
        def __init__(self) -> None:
            super().__init__(trained_agents="write|rewrite")

        def rollout(self, task: object, resources: object, rollout: object) -> float:
            return 1.0

    with pytest.warns(UserWarning, match=r"--agent-match 'write\|rewrite'"):
        agent = Writer()
    assert agent.trained_agents == "write|rewrite"
    assert LitAgent().trained_agents is None
