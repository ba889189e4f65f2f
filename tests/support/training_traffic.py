"""Hand-written span sets and lifecycle records of attempts, for the training unit tests."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from agl_stream.agent.llm import LLMCall
from agl_stream.events import (
    AttemptFinished,
    AttemptStarted,
    AttemptStatus,
    Event,
    RolloutFinished,
    RolloutMode,
    RolloutQueued,
    RolloutStatus,
    SpanRecorded,
)
from agl_stream.training.trajectories import Assembler, TopicPartition, Trajectory

Record = tuple[TopicPartition, Event]


def span(
    rollout_id: str, attempt_id: str, sequence: int, name: str, at: int, **attributes: Any
) -> SpanRecorded:
    return SpanRecorded(
        rollout_id=rollout_id, attempt_id=attempt_id, sequence=sequence,
        trace_id="0" * 31 + "1", span_id=f"{sequence + 1:016x}", name=name,
        start_time_unix_nano=at, end_time_unix_nano=at + 1, attributes=attributes,
    )  # fmt: skip


def llm_span(
    rollout_id: str,
    attempt_id: str,
    sequence: int,
    at: int,
    prompt_ids: Sequence[int] | None,
    response_ids: Sequence[int] | None,
    messages: list[dict[str, str]] | None = None,
    completion: str = "ok",
    logprobs: Sequence[float] | None = None,
    policy: str | None = None,
) -> SpanRecorded:
    call = LLMCall(
        model="m", completion=completion, messages=messages, prompt_text=None if messages else "p",
        prompt_token_ids=prompt_ids, response_token_ids=response_ids, response_logprobs=logprobs,
        policy=policy,
    )  # fmt: skip
    return span(rollout_id, attempt_id, sequence, "agl.llm.call", at, **call.attributes())


def reward_span(
    rollout_id: str,
    attempt_id: str,
    sequence: int,
    at: int,
    value: float,
    policy: str | None = None,
) -> SpanRecorded:
    named = {} if policy is None else {"agl.reward.policy": policy}
    return span(
        rollout_id, attempt_id, sequence, "agl.reward", at, **{"agl.reward": value, **named}
    )


def attempt_records(
    rollout_id: str,
    spans: Sequence[SpanRecorded],
    attempt_id: str | None = None,
    reward: float | None = 1.0,
    status: AttemptStatus = AttemptStatus.SUCCEEDED,
    mode: RolloutMode = RolloutMode.TRAIN,
    group: str = "g",
    resources_id: str | None = "run-v0",
    attempt_number: int = 1,
    finish_rollout: bool = True,
) -> list[Record]:
    """One attempt's records in the order its runner wrote them (tasks, rollouts, spans
    partition 0)."""
    attempt_id = attempt_id or uuid.uuid4().hex
    queued = RolloutQueued(
        rollout_id=rollout_id, attempt_number=attempt_number, input_json=json.dumps({"q": group}),
        mode=mode, max_attempts=max(attempt_number, 2), metadata={"group": group},
    )  # fmt: skip
    started = AttemptStarted(
        rollout_id=rollout_id, attempt_id=attempt_id, attempt_number=attempt_number,
        worker_id="w", resources_id=resources_id,
    )  # fmt: skip
    finished = AttemptFinished(
        rollout_id=rollout_id, attempt_id=attempt_id, attempt_number=attempt_number,
        worker_id="w", status=status, span_count=len(spans), reward=reward,
    )  # fmt: skip
    out: list[Record] = [(("tasks", 0), queued), (("rollouts", 0), started)]
    out += [(("spans", 0), s) for s in spans]
    out.append((("rollouts", 0), finished))
    if finish_rollout:
        end_status = (
            RolloutStatus.SUCCEEDED if status == AttemptStatus.SUCCEEDED else RolloutStatus.FAILED
        )
        end = RolloutFinished(
            rollout_id=rollout_id,
            status=end_status,
            attempt_id=attempt_id,
            attempt_count=attempt_number,
        )
        out.append((("rollouts", 0), end))
    return out


def one_call_attempt(
    rollout_id: str, group: str = "g", reward: float = 1.0, **kw: Any
) -> list[Record]:
    attempt_id = kw.pop("attempt_id", None) or uuid.uuid4().hex
    spans = [
        llm_span(rollout_id, attempt_id, 0, 10, [1, 2], [3, 4], logprobs=[-0.5, -0.25]),
        reward_span(rollout_id, attempt_id, 1, 20, reward),
    ]
    return attempt_records(
        rollout_id, spans, attempt_id=attempt_id, reward=reward, group=group, **kw
    )


def with_offsets(records: Sequence[Record]) -> list[tuple[TopicPartition, int, Event]]:
    """Offsets as a broker would give them: counting per partition."""
    next_offset: dict[TopicPartition, int] = {}
    out = []
    for tp, event in records:
        offset = next_offset.get(tp, 0)
        next_offset[tp] = offset + 1
        out.append((tp, offset, event))
    return out


def run_all(assembler: Assembler, records: Sequence[Record]) -> list[Trajectory]:
    """Every record through the assembler in order; the trajectories it completes, settled."""
    out = []
    for tp, offset, event in with_offsets(records):
        assembler.add(tp, offset, event)
        ready = assembler.complete()
        assembler.settle(t.key for t in ready)
        out += ready
    return out
