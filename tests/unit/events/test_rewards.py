"""Reward spans in agl-stream's form and in the forms Agent Lightning writes: read by the
attempt's recorder (the reward on AttemptFinished) and by the trainer's adapters alike."""

from __future__ import annotations

import json

import pytest

from agl_stream.agent import emit_reward
from agl_stream.agent.tracing import AttemptRecorder, current_recorder, tracer
from agl_stream.events.reward_rules import span_reward
from agl_stream.training.trajectories import Assembler
from agl_stream.training.triplets import RewardRule, build_triplets
from tests.support.training_traffic import attempt_records, llm_span, run_all, span

# What Agent Lightning 0.3's `emit_reward({"acc": 0.75, "len": 3.0}, primary_key="acc")`
# writes (agentlightning/emitter/reward.py: the primary dimension first, flattened).
AL_ANNOTATION = {
    "agentlightning.reward.0.name": "acc",
    "agentlightning.reward.0.value": 0.75,
    "agentlightning.reward.1.name": "len",
    "agentlightning.reward.1.value": 3.0,
}


@pytest.mark.parametrize(
    ("name", "attributes", "expected"),
    [
        ("agl.reward", {"agl.reward": 0.5, "agl.reward.primary": "reward"}, 0.5),
        ("agentlightning.annotation", AL_ANNOTATION, 0.75),
        (
            "any.span",
            {"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": 1},
            1.0,
        ),
        ("agentops", {"agentops.task.output": json.dumps({"type": "reward", "value": 0.25})}, 0.25),
        ("agentops", {"agentops.entity.output": '{"type": "reward", "value": -1.5}'}, -1.5),
        ("agentlightning.annotation", {"reward": 0.125}, 0.125),  # Agent Lightning 0.2
        # Not rewards:
        ("agl.llm.call", {"agl.reward": 0.5}, None),  # agl-stream's key on another span
        ("agentops", {"agentops.task.output": '{"type": "answer", "value": 1}'}, None),
        ("agentops", {"agentops.task.output": "not json"}, None),
        ("agentlightning.annotation", {"agentlightning.tag": "x"}, None),
        ("agl.reward", {"agl.reward": True}, None),
        ("agl.reward", {"agl.reward": float("nan")}, None),
        ("agl.reward", None, None),
    ],
)
def test_span_reward_reads_each_form(
    name: str, attributes: dict[str, object] | None, expected: float | None
) -> None:
    assert span_reward(name, attributes) == expected


def test_the_recorder_takes_the_last_reward_in_either_form() -> None:
    recorder = AttemptRecorder("ro", "at")
    token = current_recorder.set(recorder)
    try:
        emit_reward(0.5)
        assert recorder.reward == 0.5
        # An agent written for Agent Lightning, emitting through OpenTelemetry directly.
        with tracer().start_as_current_span("agentlightning.annotation", attributes=AL_ANNOTATION):
            pass
        assert recorder.reward == 0.75
    finally:
        current_recorder.reset(token)


def test_trainer_reads_agent_lightning_rewards_per_call_and_final() -> None:
    rid, aid = "r1", "a1"
    spans = [
        llm_span(rid, aid, 0, 1, [1], [2]),
        span(rid, aid, 1, "agentlightning.annotation", 2, **AL_ANNOTATION),
        llm_span(rid, aid, 2, 3, [3], [4]),
        span(rid, aid, 3, "agentlightning.annotation", 4, reward=0.25),
    ]
    [trajectory] = run_all(Assembler(), attempt_records(rid, spans, attempt_id=aid, reward=None))
    assert trajectory.reward == 0.25  # the last reward span's
    per_call = build_triplets(trajectory, RewardRule.PER_CALL)
    assert [t.reward for t in per_call.triplets] == [0.75, 0.25]
