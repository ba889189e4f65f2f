"""Dataset records from attempts (pure): SFT transcripts, RL triplets, preference pairs."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from agl_stream.agent.llm import LLMCall
from agl_stream.export.records import AttemptCalls, pairs, transcript, triplets


def _attempt(rollout_id: str, reward: float | None, answer: str, group: str = "g") -> AttemptCalls:
    ask = [{"role": "user", "content": "hi"}]
    call = LLMCall(
        model="m", completion=answer, messages=ask, prompt_token_ids=[1, 2],
        response_token_ids=[3], response_logprobs=[-0.5],
    )  # fmt: skip
    return AttemptCalls(
        rollout_id, f"{rollout_id}-a", "train", {"q": 1}, {"group": group},
        datetime(2026, 11, 1, tzinfo=UTC), reward, (call.attributes(),),
    )  # fmt: skip


def test_a_transcript_is_an_sft_line_with_its_reward() -> None:
    record = transcript(_attempt("r1", 0.5, "hello"))
    assert record["messages"] == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
    ]  # fmt: skip
    assert (record["reward"], record["finished_at"]) == (0.5, "2026-11-01T00:00:00+00:00")
    json.dumps(record)  # JSON-ready


def test_triplets_carry_token_ids_and_text() -> None:
    (record,) = triplets(_attempt("r1", 1.0, "yo"))
    assert (record["prompt_token_ids"], record["response_token_ids"]) == ([1, 2], [3])
    assert record["prompt_messages"] == [{"role": "user", "content": "hi"}]
    assert (record["prompt_text"], record["completion"], record["call_index"]) == (None, "yo", 0)


def test_pairs_match_the_best_with_the_worst_while_rewards_differ() -> None:
    group = [
        _attempt("a", 1.0, "best"), _attempt("b", 0.0, "worst"), _attempt("c", 0.5, "mid"),
        _attempt("d", 0.5, "mid too"), _attempt("e", None, "unrated"),
    ]  # fmt: skip
    made = list(pairs(group))
    assert [(p["chosen_rollout_id"], p["rejected_rollout_id"]) for p in made] == [("a", "b")]
    assert made[0]["chosen"] == [{"role": "assistant", "content": "best"}]
    assert made[0]["prompt"] == [{"role": "user", "content": "hi"}]
