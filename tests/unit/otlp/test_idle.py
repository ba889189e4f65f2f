"""Ingested attempts ended by an idle timeout (agl_stream.otlp.idle): when one is due, what
ends it, and how far its reader may commit so that a restart neither misses nor ends twice."""

from __future__ import annotations

import pytest

from agl_stream.events import (
    AttemptFinished,
    AttemptStarted,
    AttemptStatus,
    AttemptTask,
    RolloutMode,
    RolloutStatus,
    SpanRecorded,
)
from agl_stream.events.reward_rules import AGL_REWARD
from agl_stream.otlp.idle import SESSIONS_LOST, IdleAttempts
from agl_stream.otlp.mapping import WORKER

R, S = ("rollouts", 0), ("spans", 0)
BOTH = (R, S)
IDLE = 10.0


def started(rollout: str, attempt: str, worker: str = WORKER) -> AttemptStarted:
    task = AttemptTask(input_json="{}", mode=RolloutMode.TRAIN)
    return AttemptStarted(
        rollout_id=rollout, attempt_id=attempt, attempt_number=1, worker_id=worker, task=task
    )


def span(rollout: str, attempt: str, sequence: int, reward: float | None = None) -> SpanRecorded:
    name, attributes = ("work", {}) if reward is None else (AGL_REWARD, {AGL_REWARD: reward})
    return SpanRecorded(
        rollout_id=rollout, attempt_id=attempt, sequence=sequence, trace_id="ab" * 16,
        span_id=f"{sequence:016x}", name=name, start_time_unix_nano=sequence,
        end_time_unix_nano=sequence + 1, attributes=attributes,
    )  # fmt: skip


def finish(rollout: str, attempt: str, span_count: int) -> AttemptFinished:
    return AttemptFinished(
        rollout_id=rollout, attempt_id=attempt, attempt_number=1, worker_id=WORKER,
        status=AttemptStatus.SUCCEEDED, span_count=span_count,
    )  # fmt: skip


def test_an_attempt_quiet_for_the_timeout_ends_with_its_distinct_spans_and_last_reward() -> None:
    idle = IdleAttempts(IDLE)
    idle.add(R, 0, started("r", "otlp-a"), 1_000)
    idle.add(S, 0, span("r", "otlp-a", 1), 1_000)
    idle.add(S, 1, span("r", "otlp-a", 2, reward=0.25), 2_000)
    idle.add(S, 2, span("r", "otlp-a", 2, reward=0.25), 3_000)  # the same span sent again
    idle.add(S, 3, span("r", "otlp-a", 3, reward=0.75), 4_000)
    assert idle.due(13_999, BOTH) == []  # 9.999 s after its last record
    (ending,) = idle.due(14_000, BOTH)
    assert ending.attempt.status is AttemptStatus.SUCCEEDED
    assert (ending.attempt.span_count, ending.attempt.reward) == (3, 0.75)
    assert ending.attempt.worker_id == WORKER and ending.idle_seconds == 10.0
    assert ending.rollout is not None and ending.rollout.status is RolloutStatus.SUCCEEDED
    assert ending.rollout.attempt_id == "otlp-a"
    assert idle.due(60_000, BOTH) == []  # ending: not again


def test_nothing_ends_before_its_partitions_are_read_to_their_end() -> None:
    idle = IdleAttempts(IDLE)
    idle.add(R, 0, started("r", "otlp-a"), 0)
    assert idle.due(60_000, [R]) == []  # its AttemptFinished may lie unread in spans' partner
    assert len(idle.due(60_000, BOTH)) == 1


def test_only_the_ingesters_attempts_are_ended() -> None:
    idle = IdleAttempts(IDLE)
    idle.add(R, 0, started("r", "0123abcd"), 0)  # a runner's
    idle.add(S, 0, span("r", "0123abcd", 1), 0)
    idle.add(R, 1, started("q", "otlp-b", worker="someone"), 0)  # not an ingester's start
    assert idle.due(60_000, BOTH) == []


def test_an_attempt_read_back_as_finished_is_not_ended_again() -> None:
    idle = IdleAttempts(IDLE)
    idle.add(R, 0, started("r", "otlp-a"), 0)
    idle.add(S, 0, span("r", "otlp-a", 1), 0)
    idle.add(R, 1, finish("r", "otlp-a", 1), 5_000)
    idle.add(S, 1, span("r", "otlp-a", 2), 6_000)  # late: after its end
    assert idle.due(60_000, BOTH) == []


def test_the_rollout_ends_with_its_last_open_ingested_attempt() -> None:
    idle = IdleAttempts(IDLE)
    idle.add(R, 0, started("r", "otlp-a"), 0)
    idle.add(R, 1, started("r", "otlp-b"), 5_000)
    (first,) = idle.due(12_000, BOTH)
    assert first.attempt.attempt_id == "otlp-a" and first.rollout is None
    (second,) = idle.due(16_000, BOTH)
    assert second.rollout is not None and second.rollout.attempt_id == "otlp-b"


def test_spans_of_an_attempt_ended_and_forgotten_long_ago_end_nothing() -> None:
    idle = IdleAttempts(IDLE)
    idle.add(S, 7, span("r", "otlp-a", 9), 0)
    assert idle.due(60_000, BOTH) == []
    assert idle.counts["late_spans_dropped"] == 1 and not idle.open


def test_the_cut_keeps_what_a_restarted_reader_needs() -> None:
    idle = IdleAttempts(IDLE)
    idle.add(R, 10, started("r", "otlp-a"), 0)
    idle.add(S, 20, span("r", "otlp-a", 1), 0)
    idle.add(R, 11, started("q", "otlp-b"), 0)
    positions = {R: 12, S: 21}
    assert idle.cut(positions) == {R: 10, S: 20}  # open attempts hold their lowest records
    # otlp-a ends (its finish read back at rollouts 30); otlp-b, started at 11, stays open.
    idle.add(R, 30, finish("r", "otlp-a", 1), 1_000)
    # A reader from rollouts 11 and spans 21 would never meet otlp-a's span again: fine.
    assert idle.cut({R: 31, S: 21}) == {R: 11, S: 21}
    # With a span of otlp-a still above the spans cut, its finish must be read again too.
    idle.add(R, 40, started("p", "otlp-c"), 1_000)
    idle.add(S, 15, span("p", "otlp-c", 1), 1_000)
    idle.add(R, 41, finish("q", "otlp-b", 0), 1_000)
    assert idle.cut({R: 42, S: 21}) == {R: 30, S: 15}
    # Replayed from that cut, the fold ends nothing twice.
    again = IdleAttempts(IDLE)
    again.add(S, 15, span("p", "otlp-c", 1), 1_000)
    again.add(S, 20, span("r", "otlp-a", 1), 0)
    again.add(R, 30, finish("r", "otlp-a", 1), 1_000)
    again.add(R, 40, started("p", "otlp-c"), 1_000)
    again.add(R, 41, finish("q", "otlp-b", 0), 1_000)
    assert [e.attempt.attempt_id for e in again.due(60_000, BOTH)] == ["otlp-c"]


def test_ended_attempts_below_the_cut_are_forgotten() -> None:
    idle = IdleAttempts(IDLE)
    idle.add(R, 0, started("r", "otlp-a"), 0)
    idle.add(R, 1, finish("r", "otlp-a", 0), 0)
    assert idle.cut({R: 2, S: 0}) == {R: 2, S: 0}
    assert not idle.ended


def test_a_partition_given_away_is_forgotten() -> None:
    idle = IdleAttempts(IDLE)
    idle.add(R, 0, started("r", "otlp-a"), 0)
    idle.add(("rollouts", 1), 0, started("q", "otlp-b"), 0)
    idle.forget([R, S])
    assert list(idle.open) == [("q", "otlp-b")]


def test_the_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="more than 0 seconds"):
        IdleAttempts(0)


def test_a_lost_gateway_session_ends_unresponsive_with_the_reason() -> None:
    idle = IdleAttempts(IDLE, SESSIONS_LOST)
    attempt = "gateway-sessions-host-1-0a1b2c3d"
    idle.add(R, 0, started("session-k", attempt, worker="gateway-sessions-host-1"), 0)
    idle.add(S, 0, span("session-k", attempt, 0), 0)
    idle.add(R, 1, started("r", "otlp-a"), 0)  # an ingester's: not a session
    (ending,) = idle.due(60_000, BOTH)
    assert ending.attempt.status is AttemptStatus.UNRESPONSIVE
    assert ending.attempt.error is not None and ending.attempt.error.type == "SessionLost"
    assert ending.attempt.worker_id == "gateway-sessions-host-1"
    assert ending.rollout is not None and ending.rollout.status is RolloutStatus.FAILED
