"""Dataset records from one attempt's LLM calls (pure): transcripts for supervised
fine-tuning, triplets with token ids for RL, and preference pairs for DPO-style training.

- transcript: `{"messages": [...], "reward": r, ...}`, the conversation the agent had (the
  last call's messages and the answer), in OpenAI's fine-tuning shape;
- triplet: one LLM call: prompt and response token ids (and logprobs), prompt and completion
  text, the call's index, the reward;
- pair: two attempts of one task (the same `group` metadata, else the same input) with
  different rewards: `{"prompt": [...], "chosen": [...], "rejected": [...]}`, TRL's
  conversational preference shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from agl_stream.agent.llm import (
    COMPLETION,
    PROMPT_JSON,
    PROMPT_TOKEN_IDS,
    RESPONSE_LOGPROBS,
    RESPONSE_TOKEN_IDS,
)
from agl_stream.training.triplets import call_messages

KINDS = ("transcripts", "triplets", "pairs")


@dataclass(frozen=True)
class AttemptCalls:
    """An attempt as the export reads it: its rollout's facts, its reward, its LLM calls
    (span attributes, in order)."""

    rollout_id: str
    attempt_id: str
    mode: str | None
    input: Any
    metadata: Mapping[str, str]
    finished_at: datetime | None
    reward: float | None
    calls: Sequence[Mapping[str, Any]]

    @property
    def group(self) -> str:
        return self.metadata.get("group") or json.dumps(self.input, sort_keys=True)


def _common(a: AttemptCalls) -> dict[str, Any]:
    return {
        "rollout_id": a.rollout_id,
        "attempt_id": a.attempt_id,
        "mode": a.mode,
        "metadata": dict(a.metadata),
        "finished_at": a.finished_at.isoformat() if a.finished_at else None,
        "reward": a.reward,
    }


def transcript(a: AttemptCalls) -> dict[str, Any]:
    return {"messages": call_messages(a.calls), **_common(a)}


def triplets(a: AttemptCalls) -> Iterator[dict[str, Any]]:
    for index, call in enumerate(a.calls):
        prompt = json.loads(str(call.get(PROMPT_JSON) or "{}"))
        messages = prompt.get("messages")
        yield {
            **_common(a),
            "call_index": index,
            "prompt_messages": messages if isinstance(messages, list) else None,
            "prompt_text": None if isinstance(messages, list) else str(prompt.get("text") or ""),
            "completion": str(call.get(COMPLETION) or ""),
            "prompt_token_ids": _ints(call.get(PROMPT_TOKEN_IDS)),
            "response_token_ids": _ints(call.get(RESPONSE_TOKEN_IDS)),
            "response_logprobs": _floats(call.get(RESPONSE_LOGPROBS)),
        }


def pairs(group: Sequence[AttemptCalls]) -> Iterator[dict[str, Any]]:
    """Within one task's attempts: the best against the worst, the second best against the
    second worst, ... while their rewards differ (each attempt in one pair at most)."""
    ranked = sorted(
        (a for a in group if a.reward is not None and a.calls),
        key=lambda a: (-(a.reward or 0.0), a.rollout_id, a.attempt_id),
    )
    while len(ranked) >= 2:
        best, worst = ranked.pop(0), ranked.pop()
        if best.reward == worst.reward:
            break
        chosen, rejected = call_messages(best.calls), call_messages(worst.calls)
        yield {
            "prompt": chosen[:-1],
            "chosen": chosen[-1:],
            "rejected": rejected[-1:],
            "chosen_reward": best.reward,
            "rejected_reward": worst.reward,
            "chosen_rollout_id": best.rollout_id,
            "rejected_rollout_id": worst.rollout_id,
            "group": best.group,
        }


def _ints(value: Any) -> list[int] | None:
    return [int(v) for v in value] if isinstance(value, list) else None


def _floats(value: Any) -> list[float] | None:
    return [float(v) for v in value] if isinstance(value, list) else None
