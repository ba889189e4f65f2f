"""Which agent made an LLM call (Agent Lightning's agent_match), and the triplets of the
calls of the agents a trainer matches."""

from __future__ import annotations

from typing import Any

from agl_stream.events import AttemptStatus, SpanRecorded
from agl_stream.training.agent_match import agent_name, calling_agent
from agl_stream.training.batching import Staleness, build_step
from agl_stream.training.trajectories import Trajectory
from agl_stream.training.triplets import build_triplets
from tests.support.training_traffic import llm_span, reward_span, span


def under(child: SpanRecorded, parent: SpanRecorded | None) -> SpanRecorded:
    return child.model_copy(update={"parent_span_id": parent.span_id if parent else None})


def agent(sequence: int, parent: SpanRecorded | None = None, **names: Any) -> SpanRecorded:
    return under(span("r", "a", sequence, "agent", sequence * 10, **names), parent)


def call(sequence: int, parent: SpanRecorded | None, prompt: int, **more: Any) -> SpanRecorded:
    return under(llm_span("r", "a", sequence, sequence * 10 + 5, [prompt], [9], **more), parent)


def trajectory(spans: list[SpanRecorded], rid: str = "r", reward: float = 1.0) -> Trajectory:
    return Trajectory(
        rollout_id=rid, attempt_id="a", attempt_number=1, input_json="{}", metadata={},
        resources_id="v", status=AttemptStatus.SUCCEEDED, reward=reward, spans=tuple(spans),
    )  # fmt: skip


def test_agent_names_are_read_where_agent_lightning_reads_them() -> None:
    named = {
        "writer": {"agent.name": "writer"},  # the OpenAI Agents SDK
        "planner": {"gen_ai.agent.name": "planner"},  # OpenTelemetry's GenAI convention
        "critic": {"agentops.span.kind": "agent", "operation.name": "critic"},  # AgentOps
        "coder": {"recipient_agent_type": "coder"},  # AutoGen
        "check": {"executor.id": "check"},  # Microsoft Agent Framework
        "graph": {"langchain.chain.type": "graph"},  # LangGraph
        "solver": {"type": "agent", "agentlightning.operation.input.name": "solver"},  # Weave
    }
    for name, attributes in named.items():
        assert agent_name(span("r", "a", 0, "x", 0, **attributes)) == name
    assert agent_name(span("r", "a", 0, "x", 0, **{"operation.name": "tool"})) is None
    assert agent_name(span("r", "a", 0, "x", 0, type="tool", tool="search")) is None
    chain = span("r", "a", 0, "langchain.Chain.write", 0, lc_name="write")
    assert agent_name(chain) == "write"


def test_the_nearest_agent_above_a_call_is_its_agent() -> None:
    team = agent(0, **{"agent.name": "team"})
    writer = agent(1, team, **{"agent.name": "writer"})
    tool = under(span("r", "a", 2, "tool.search", 20), writer)
    deep = call(3, tool, 1)  # under a tool under the writer
    direct = call(4, team, 2)
    alone = call(5, None, 3)
    looped = call(6, None, 4).model_copy(update={"parent_span_id": f"{7:016x}"})  # itself
    by_id = {s.span_id: s for s in (team, writer, tool, deep, direct, alone, looped)}
    assert calling_agent(deep, by_id) == "writer"
    assert calling_agent(direct, by_id) == "team"
    assert calling_agent(alone, by_id) is None
    assert calling_agent(looped, by_id) is None


def test_only_the_matching_agents_calls_are_trained_on() -> None:
    """A writer and a checker call the same policy; agent_match "write" trains the writer's
    call alone, as Agent Lightning's adapter would; a checker nested in the writer is the
    checker's (the nearest agent decides); a call under no agent is never matched."""
    writer = agent(0, **{"agent.name": "writer"})
    checker = agent(1, writer, **{"agent.name": "checker"})
    spans = [
        writer, checker,
        call(2, writer, 11), call(3, checker, 12), call(4, None, 13),
        reward_span("r", "a", 5, 60, 1.0),
    ]  # fmt: skip
    prompts = {
        match: [t.prompt_ids for t in build_triplets(trajectory(spans), agent_match=match).triplets]
        for match in (None, "write", "^check", "writer|checker")
    }
    assert prompts == {
        None: [(11,), (12,), (13,)],
        "write": [(11,)],
        "^check": [(12,)],
        "writer|checker": [(11,), (12,)],
    }
    problems = build_triplets(trajectory(spans), policy="speaker", agent_match="judge").problems
    assert [p.reason for p in problems] == [
        "no LLM call spans of policy 'speaker' made by an agent matching 'judge'"
    ]


def test_a_step_takes_the_matching_agents_calls_of_its_policy() -> None:
    """The policy filter and the agent match together: the listener's calls made by the
    listener agent, not those of a judge calling the same policy."""

    def attempt(rid: str, reward: float) -> Trajectory:
        listener = agent(0, **{"agent.name": "listener"})
        judge = agent(1, **{"agent.name": "judge"})
        return trajectory([
            listener, judge,
            call(2, listener, 21, policy="listener"), call(3, judge, 22, policy="listener"),
            call(4, listener, 23, policy="speaker"), reward_span(rid, "a", 5, 60, reward),
        ], rid=rid, reward=reward)  # fmt: skip

    groups = [[attempt("r1", 1.0), attempt("r2", 0.0)]]
    step = build_step(groups, {"v": 0}, 0, Staleness(), policy="listener", agent_match="listener")
    assert [(s.key[0], s.prompt_ids) for s in step.samples] == [("r1", (21,)), ("r2", (21,))]
    every = build_step(groups, {"v": 0}, 0, Staleness(), policy="listener")
    assert [s.prompt_ids for s in every.samples] == [(21,), (22,), (21,), (22,)]
