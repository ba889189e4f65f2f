"""Adapters from a trajectory's spans to training data (pure code).

Triplets: one (prompt token ids, response token ids, reward) per LLM call, in call order.
The reward of each call is set by a rule:

- `final` (default): every call gets the attempt's final reward (the reward on its
  AttemptFinished, else its last reward span: `agl.reward`, or a form Agent Lightning
  writes, see `agl_stream.events.reward_rules`).
- `per_call`: each reward span belongs to the LLM call that ended last before it; a
  call's reward is the sum of its rewards, 0.0 when it has none. An agent that only emits a
  final reward so rewards its last call alone. A late reward (a trainer's late-reward rule)
  goes to the call it names, else to the last call.
- `discounted`: the final reward times gamma ** (calls after this one), so later calls, closer
  to the outcome, get more of it.

A call whose span lacks prompt or response token ids cannot be trained on: it is reported
as a problem (rollout, attempt, span) and left out, never dropped silently.

With several policies, each trainer takes the calls of its own policy (the span's
`agl.llm.policy`; a call without it is the default policy's); the rules above apply to those
calls. The attempt's reward is shared by all its policies, unless a reward span names the
policy (`agl.reward.policy`, `emit_reward(..., policy=)`): its last such reward is that
policy's final reward, and under `per_call` reward spans naming another policy are left out.

With an agent match (Agent Lightning's `agent_match`), a trainer takes only the calls made
inside the spans of the agents it matches (agent_match.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from agl_stream.agent.llm import (
    COMPLETION,
    DEFAULT_POLICY,
    LLM_CALL_SPAN,
    POLICY,
    PROMPT_JSON,
    PROMPT_TOKEN_IDS,
    RESPONSE_LOGPROBS,
    RESPONSE_TOKEN_IDS,
)
from agl_stream.events import SpanRecorded, StatusCode
from agl_stream.events.reward_rules import reward_policy, span_reward
from agl_stream.training.agent_match import made_by_matching_agents
from agl_stream.training.trajectories import Trajectory


class RewardRule(StrEnum):
    FINAL = "final"
    PER_CALL = "per_call"
    DISCOUNTED = "discounted"


@dataclass(frozen=True)
class Triplet:
    rollout_id: str
    attempt_id: str
    call_index: int
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    reward: float
    logprobs: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Problem:
    """Something in a trajectory that kept data out of training."""

    rollout_id: str
    attempt_id: str
    span_id: str | None
    reason: str

    def __str__(self) -> str:
        where = f"rollout {self.rollout_id} attempt {self.attempt_id}"
        return (
            f"{where} span {self.span_id}: {self.reason}"
            if self.span_id
            else f"{where}: {self.reason}"
        )


@dataclass
class Adapted:
    triplets: list[Triplet] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


def call_policy(span: SpanRecorded) -> str:
    """The policy that answered an LLM call."""
    return str(span.attributes.get(POLICY) or DEFAULT_POLICY)


def llm_calls(
    trajectory: Trajectory, policy: str | None = None, agent_match: str | None = None
) -> list[SpanRecorded]:
    """The LLM-call spans that got an answer (of `policy` only, when it is given; made by an
    agent that `agent_match` matches only, when it is given: agent_match.py), in the order
    the calls ended (then by sequence). A failed call (the upstream died, timed out, refused)
    produced no tokens."""
    calls = [
        s
        for s in trajectory.spans
        if s.name == LLM_CALL_SPAN
        and s.status.code is not StatusCode.ERROR
        and (policy is None or call_policy(s) == policy)
    ]
    if agent_match is not None:
        calls = made_by_matching_agents(calls, trajectory.spans, agent_match)
    return sorted(calls, key=lambda s: (s.end_time_unix_nano, s.sequence))


def _ints(value: Any) -> tuple[int, ...] | None:
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return None
    return tuple(value)


def _floats(value: Any, length: int) -> tuple[float, ...] | None:
    if not isinstance(value, list) or len(value) != length:
        return None
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        return None
    return tuple(float(v) for v in value)


def policy_reward(trajectory: Trajectory, policy: str | None) -> float | None:
    """The final reward of `policy` in a trajectory: the last reward span naming it, else
    the attempt's reward (shared by its policies)."""
    if policy is not None:
        named = [
            (s.end_time_unix_nano, s.sequence, value)
            for s in trajectory.spans
            if reward_policy(s.attributes) == policy
            and (value := span_reward(s.name, s.attributes)) is not None
        ]
        if named:
            return max(named)[2]
    return trajectory.reward


def _call_rewards(
    trajectory: Trajectory,
    calls: Sequence[SpanRecorded],
    rule: RewardRule,
    gamma: float,
    policy: str | None = None,
) -> list[float]:
    final = policy_reward(trajectory, policy) or 0.0
    if rule is RewardRule.FINAL:
        return [final] * len(calls)
    if rule is RewardRule.DISCOUNTED:
        return [final * gamma ** (len(calls) - 1 - i) for i in range(len(calls))]
    rewards = [0.0] * len(calls)
    late = trajectory.late_reward
    if late is not None:  # to the call it names, else to the last one
        named = [i for i, c in enumerate(calls) if c.span_id == late.span_id]
        rewards[named[0] if named else len(calls) - 1] += late.value
    for span in trajectory.spans:
        value = span_reward(span.name, span.attributes)
        owner = reward_policy(span.attributes)
        if value is None or (owner is not None and owner != policy):
            continue
        before = [
            i for i, c in enumerate(calls) if c.end_time_unix_nano <= span.start_time_unix_nano
        ]
        if before:
            rewards[before[-1]] += value
    return rewards


def build_triplets(
    trajectory: Trajectory,
    rule: RewardRule = RewardRule.FINAL,
    gamma: float = 0.9,
    policy: str | None = None,
    agent_match: str | None = None,
) -> Adapted:
    """The triplets of a trajectory's calls (of `policy` only, when it is given; made by the
    agents `agent_match` matches only, when it is given)."""
    adapted = Adapted()
    rid, aid = trajectory.rollout_id, trajectory.attempt_id
    calls = llm_calls(trajectory, policy, agent_match)
    if not calls:
        of = "" if policy is None else f" of policy {policy!r}"
        by = "" if agent_match is None else f" made by an agent matching {agent_match!r}"
        adapted.problems.append(Problem(rid, aid, None, f"no LLM call spans{of}{by}"))
        return adapted
    if policy_reward(trajectory, policy) is None and rule is not RewardRule.PER_CALL:
        adapted.problems.append(Problem(rid, aid, None, "no reward (no reward span)"))
        return adapted
    rewards = _call_rewards(trajectory, calls, rule, gamma, policy)
    for index, (span, reward) in enumerate(zip(calls, rewards, strict=True)):
        prompt = _ints(span.attributes.get(PROMPT_TOKEN_IDS))
        response = _ints(span.attributes.get(RESPONSE_TOKEN_IDS))
        missing = [
            name for name, ids in (("prompt", prompt), ("response", response)) if ids is None
        ]
        if missing or prompt is None or response is None:
            reason = f"LLM call {index} has no {' or '.join(missing)} token ids"
            adapted.problems.append(Problem(rid, aid, span.span_id, reason))
            continue
        logprobs = _floats(span.attributes.get(RESPONSE_LOGPROBS), len(response))
        adapted.triplets.append(Triplet(rid, aid, index, prompt, response, reward, logprobs))
    return adapted


# -- messages: chat transcripts with rewards --------------------------------------------------


@dataclass(frozen=True)
class Transcript:
    rollout_id: str
    attempt_id: str
    messages: tuple[dict[str, str], ...]
    reward: float | None


def build_transcript(trajectory: Trajectory) -> Transcript:
    """The conversation as the agent had it: the last call's messages (or each call's
    prompt text) followed by the model's answers, with the attempt's final reward."""
    messages = call_messages(span.attributes for span in llm_calls(trajectory))
    return Transcript(
        trajectory.rollout_id, trajectory.attempt_id, tuple(messages), trajectory.reward
    )


def call_messages(calls: Iterable[Mapping[str, Any]]) -> list[dict[str, str]]:
    """The conversation told by LLM-call span attributes, in call order: the last call's
    messages (or each call's prompt text), each followed by the model's answer."""
    messages: list[dict[str, str]] = []
    for attributes in calls:
        prompt = json.loads(str(attributes.get(PROMPT_JSON) or "{}"))
        sent = prompt.get("messages")
        if isinstance(sent, list):
            # Each call sends the conversation so far: the latest one is the whole of it.
            messages = [{str(k): str(v) for k, v in m.items()} for m in sent]
        elif prompt.get("text"):
            messages.append({"role": "user", "content": str(prompt["text"])})
        messages.append({"role": "assistant", "content": str(attributes.get(COMPLETION) or "")})
    return messages


def finetune_jsonl(transcripts: Sequence[Transcript], min_reward: float | None = None) -> str:
    """OpenAI fine-tuning JSONL: one {"messages": [...]} line per transcript, keeping those
    whose reward reaches `min_reward` (rejection sampling) when it is given."""
    lines = []
    for t in transcripts:
        if min_reward is not None and (t.reward is None or t.reward < min_reward):
            continue
        lines.append(json.dumps({"messages": list(t.messages), "reward": t.reward}, sort_keys=True))
    return "".join(line + "\n" for line in lines)
