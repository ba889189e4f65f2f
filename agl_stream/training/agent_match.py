"""Which agent made an LLM call, for training only the calls of some agents (pure code).

Agent Lightning's `agent_match` (its trace adapter's option; `LitAgent(trained_agents=...)`
before 0.3) is a regular expression over agent names: a call is trained when the nearest
span above it that names an agent names one the expression matches (`re.search`); a call
under no agent span, or under an agent that does not match, is not. The same rule here, on
the spans an attempt recorded (their parent ids), with the agent names read from the
attributes Agent Lightning reads (the OpenAI Agents SDK, AgentOps' `@agent`, AutoGen,
LangGraph, Microsoft Agent Framework, Weave) and OpenTelemetry's `gen_ai.agent.name`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from agl_stream.events import SpanRecorded

# Where a span names the agent it stands for, in the order Agent Lightning looks (after
# OpenTelemetry's own attribute): (attribute, value it must have or None, attribute naming
# the agent).
_NAMED_BY: tuple[tuple[str, str | None, str], ...] = (
    ("gen_ai.agent.name", None, "gen_ai.agent.name"),
    ("agent.name", None, "agent.name"),  # the OpenAI Agents SDK
    ("agentops.span.kind", "agent", "operation.name"),  # AgentOps' @agent
    ("recipient_agent_type", None, "recipient_agent_type"),  # AutoGen
    ("langchain.chain.type", None, "langchain.chain.type"),  # LangGraph
    ("executor.id", None, "executor.id"),  # Microsoft Agent Framework
    ("type", "agent", "agentlightning.operation.input.name"),  # Weave
)


def agent_name(span: SpanRecorded) -> str | None:
    """The agent a span stands for, if it is an agent's span."""
    attributes = span.attributes
    for key, value, name_key in _NAMED_BY:
        if key in attributes and (value is None or attributes[key] == value):
            name = attributes.get(name_key)
            if isinstance(name, str):
                return name
    if span.name.startswith("langchain.Chain.") and isinstance(attributes.get("lc_name"), str):
        return str(attributes["lc_name"])  # Weave with LangChain
    return None


def calling_agent(span: SpanRecorded, by_id: Mapping[str, SpanRecorded]) -> str | None:
    """The agent of the nearest span above `span` that names one (None: no agent above)."""
    seen = {span.span_id}
    parent = span.parent_span_id
    while parent is not None and parent not in seen and parent in by_id:
        seen.add(parent)
        above = by_id[parent]
        name = agent_name(above)
        if name is not None:
            return name
        parent = above.parent_span_id
    return None


def made_by_matching_agents(
    calls: Iterable[SpanRecorded], spans: Iterable[SpanRecorded], agent_match: str
) -> list[SpanRecorded]:
    """The calls whose agent `agent_match` matches, among the attempt's `spans`."""
    pattern = re.compile(agent_match)
    by_id = {s.span_id: s for s in spans}
    kept = []
    for call in calls:
        name = calling_agent(call, by_id)
        if name is not None and pattern.search(name):
            kept.append(call)
    return kept
