"""Late and external rewards, the pure parts: who counts (one partition's order decides),
the read model's admission and task rows, the trainer's late-reward rule, the HTTP body."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_stream.bus.streams import ConsumedEvent
from agl_stream.commands.rewards import BadReward, make_reward
from agl_stream.events import (
    AttemptStarted,
    AttemptTask,
    Event,
    RewardRecorded,
    RolloutMode,
    RolloutQueued,
)
from agl_stream.events.reward_rules import (
    FUTURE_REWARD,
    UNKNOWN_ATTEMPT,
    UNKNOWN_ROLLOUT,
    late_reward_refusal,
)
from agl_stream.gateway.reward_route import BadRewards, parse_rewards
from agl_stream.projection.apply import refused_rewards
from agl_stream.projection.fold import State, project
from agl_stream.training.batching import Staleness, build_step
from agl_stream.training.trajectories import Assembler, LateRewardRule, MissingLateReward
from agl_stream.training.triplets import RewardRule, build_triplets
from tests.support.training_traffic import Record, one_call_attempt, with_offsets


def test_a_reward_counts_only_after_an_attempt_of_its_rollout() -> None:
    assert late_reward_refusal("r", None, [])[0] == UNKNOWN_ROLLOUT  # type: ignore[index]
    assert late_reward_refusal("r", "a2", ["a1"])[0] == UNKNOWN_ATTEMPT  # type: ignore[index]
    assert late_reward_refusal("r", None, ["a1"]) is None
    assert late_reward_refusal("r", "a1", ["a1"]) is None


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_reward_must_be_finite(value: float) -> None:
    with pytest.raises(BadReward, match="finite"):
        make_reward("r", value)


def test_a_call_is_named_by_its_span_id() -> None:
    with pytest.raises(BadReward, match="span_id"):
        make_reward("r", 1.0, span_id="not-a-span")
    assert make_reward("r", 1.0, span_id="00f067aa0ba902b7").span_id == "00f067aa0ba902b7"


def _consumed(events: list[Event]) -> list[ConsumedEvent]:
    return [ConsumedEvent(e, "agl.rollouts", 0, i, None) for i, e in enumerate(events)]


def _reward(rollout_id: str, attempt_id: str | None = None, **kw: object) -> RewardRecorded:
    return make_reward(rollout_id, kw.pop("value", 1.0), attempt_id=attempt_id, **kw)  # type: ignore[arg-type]


def _started(rollout_id: str, attempt_id: str) -> AttemptStarted:
    return AttemptStarted(
        rollout_id=rollout_id, attempt_id=attempt_id, attempt_number=1, worker_id="w"
    )


def test_the_projector_refuses_rewards_by_their_partition_order() -> None:
    before, after, named_wrong = _reward("r1"), _reward("r1"), _reward("r1", "other")
    known_in_db = _reward("r2", "a2")
    batch = _consumed([before, _started("r1", "a1"), after, named_wrong, known_in_db])
    state = State()
    state.attempts[("r2", "a2")] = project([_started("r2", "a2")], State()).attempts[0]
    refused = refused_rewards(batch, state)
    kinds = {item.event.event_id: kind for item, kind, _ in refused.values()}
    assert kinds == {before.event_id: UNKNOWN_ROLLOUT, named_wrong.event_id: UNKNOWN_ATTEMPT}
    reasons = [reason for _, _, reason in refused.values()]
    assert all("r1" in reason for reason in reasons)


def test_an_unqueued_attempt_gives_its_rollout_a_task_until_a_queued_one_comes() -> None:
    task = AttemptTask(input_json='{"messages": []}', mode=RolloutMode.TRAIN, metadata={"s": "k"})
    started = AttemptStarted(
        rollout_id="s-1", attempt_id="a", attempt_number=1, worker_id="gw", task=task
    )
    queued = RolloutQueued(rollout_id="s-1", attempt_number=1, input_json="1", mode="val")
    alone = project([started], State()).rollouts[0]
    assert (alone.mode, alone.input, alone.metadata, alone.status) == (
        "train", {"messages": []}, {"s": "k"}, "running",
    )  # fmt: skip
    for order in ([started, queued], [queued, started]):
        row = project(order, State()).rollouts[0]
        assert (row.mode, row.input) == ("val", 1)


def test_rewards_are_rows_of_their_own() -> None:
    reward = _reward("r1", "a1", name="thumbs", value=-1.0, source="http")
    rows = project([reward, reward], State()).rewards
    assert {(r.rollout_id, r.attempt_id, r.name, r.value) for r in rows} == {
        ("r1", "a1", "thumbs", -1.0)
    }


# -- the trainer's late-reward rule ----------------------------------------------------------

T0 = 1_800_000_000_000  # ms


def _feed(
    assembler: Assembler, records: list[Record], times: dict[int, int] | None = None
) -> list[object]:
    """Records at T0 + their index (or the given broker times, by index)."""
    out: list[object] = []
    for i, (tp, offset, event) in enumerate(with_offsets(records)):
        assembler.add(tp, offset, event, (times or {}).get(i, T0 + i))
        out += assembler.complete()
    return out


def _late(rollout_id: str, attempt_id: str | None, value: float, **kw: object) -> Record:
    return (("rollouts", 0), _reward(rollout_id, attempt_id, value=value, **kw))


def _attempt(rollout_id: str) -> tuple[list[Record], str]:
    records = one_call_attempt(rollout_id, reward=0.0, attempt_id=f"{rollout_id}-a")
    return records, f"{rollout_id}-a"


def test_a_trajectory_waits_for_its_named_late_reward_and_trains_on_it() -> None:
    records, attempt = _attempt("r")
    assembler = Assembler(late_reward=LateRewardRule("thumbs", wait_seconds=60))
    assert _feed(assembler, records) == []  # complete, but waiting
    assert assembler.cut({("rollouts", 0): 9})[("rollouts", 0)] == 0  # it holds the cut
    other_name = _late("r", None, 5.0, name="ci")
    ready = _feed(assembler, [*records, other_name, _late("r", attempt, 0.75, name="thumbs")])
    (trajectory,) = ready
    assert trajectory.reward == 0.75 and trajectory.reward_from == "late"  # type: ignore[attr-defined]


def test_a_late_reward_past_the_bound_does_not_count() -> None:
    records, _ = _attempt("r")
    end = len(records) - 2  # the AttemptFinished's index
    late = _late("r", None, 1.0, name="thumbs")
    times = {len(records): T0 + end + 61_000}  # stamped 61 s after the attempt's end
    for missing, expected in ((MissingLateReward.DROP, "dropped"), ("final", "fallback")):
        assembler = Assembler(late_reward=LateRewardRule("thumbs", 60, MissingLateReward(missing)))
        ready = _feed(assembler, [*records, late], times)
        dropped = assembler.dropped()
        got = [t.reward_from for t in (*ready, *dropped)]  # type: ignore[attr-defined]
        assert got == [expected]
        if expected == "fallback":
            assert ready[0].reward == 0.0  # type: ignore[attr-defined]


def test_broker_time_passing_at_the_partition_end_decides_too() -> None:
    records, _ = _attempt("r")
    assembler = Assembler(late_reward=LateRewardRule("thumbs", 1, MissingLateReward.DROP))
    _feed(assembler, records)
    assembler.tick(T0 + 500, [("rollouts", 0)])
    assert assembler.dropped() == []
    assembler.tick(T0 + 10_000, [("rollouts", 1)])  # another partition's time
    assert assembler.dropped() == []
    assembler.tick(T0 + 10_000, [("rollouts", 0)])
    assert [t.reward_from for t in assembler.dropped()] == ["dropped"]


def test_a_reward_before_its_attempt_is_refused_by_the_trainer_too() -> None:
    records, _ = _attempt("r")
    early = _late("r", None, 1.0, name="thumbs")
    assembler = Assembler(late_reward=LateRewardRule("thumbs", 3600))
    assert _feed(assembler, [records[0], early, *records[1:]]) == []
    assert assembler.counts["late_rewards_refused"] == 1


def test_the_first_reward_in_the_partition_counts_and_per_call_gives_it_to_its_call() -> None:
    records, attempt = _attempt("r")
    at = datetime(2026, 11, 1, tzinfo=UTC)
    first = _late("r", attempt, 0.1, name="thumbs", given_at=at + timedelta(seconds=5))
    earlier = _late("r", attempt, 0.9, name="thumbs", given_at=at)
    assembler = Assembler(late_reward=LateRewardRule("thumbs", 60))
    # the first in the partition counts, whenever it was given
    (trajectory,) = _feed(assembler, [*records, first, earlier])
    assert trajectory.reward == 0.1  # type: ignore[attr-defined]
    per_call = build_triplets(trajectory, RewardRule.PER_CALL)  # type: ignore[arg-type]
    # the reward span (0.0) and the late reward (0.1) both go to the one call
    assert [t.reward for t in per_call.triplets] == [0.1]
    step = build_step([[trajectory]], {"run-v0": 0}, 0, Staleness())  # type: ignore[list-item]
    assert step.counts["late_reward_late"] == 1


@settings(max_examples=40, deadline=None)
@given(st.permutations(range(4)))
def test_without_a_rule_late_rewards_change_nothing(order: list[int]) -> None:
    records, attempt = _attempt("r")
    late = [_late("r", attempt, float(i), name="thumbs") for i in range(4)]
    assembler = Assembler()
    (trajectory,) = _feed(assembler, [*records, *(late[i] for i in order)][: len(records) + 4])
    assert trajectory.reward == 0.0 and trajectory.reward_from == "final"  # type: ignore[attr-defined]


# -- POST /rewards bodies --------------------------------------------------------------------


def test_reward_bodies_one_or_many_with_sessions() -> None:
    body = [
        {"rollout_id": "r1", "value": 1, "name": "thumbs", "metadata": {"u": "9"}},
        {"session": "conv-7", "value": -0.5, "given_at": "2026-11-20T10:00:00Z",
         "event_id": "12345678-1234-5678-1234-567812345678"},
    ]  # fmt: skip
    one, two = parse_rewards(json.dumps(body).encode(), lambda key: f"session-{key}")
    assert (one.rollout_id, one.value, one.name, one.source) == ("r1", 1.0, "thumbs", "http")
    assert (two.rollout_id, two.occurred_at.hour) == ("session-conv-7", 10)
    assert isinstance(one.event_id, uuid.UUID)
    assert two.event_id == uuid.UUID("12345678-1234-5678-1234-567812345678")


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{", "not JSON"),
        (b"[]", "empty list"),
        (b'[{"rollout_id": "r", "value": 1}, 3]', "reward 1 is not a JSON object"),
        (b'{"rollout_id": "r"}', "value must be a number"),
        (b'{"rollout_id": "r", "value": true}', "value must be a number"),
        (b'{"rollout_id": "r", "value": 1e400}', "finite"),
        (b'{"value": 1}', "rollout_id must be a non-empty string"),
        (b'{"rollout_id": "r", "value": 1, "colour": "red"}', "unknown fields ['colour']"),
        (b'{"session": "k", "value": 1}', "this server has no sessions"),
        (b'{"rollout_id": "r", "value": 1, "given_at": "2026-11-27T10:00:00"}', "time zone"),
        (b'{"rollout_id": "r", "value": 1, "given_at": "yesterday"}', "Invalid isoformat"),
        (b'{"rollout_id": "r", "value": 1, "given_at": "9999-12-31T23:59:59Z"}', "in the future"),
        (b'{"rollout_id": "r", "value": 1, "span_id": "xyz"}', "span_id"),
        (b'{"rollout_id": "r", "value": 1, "event_id": "nope"}', "event_id"),
    ],
)
def test_bad_reward_bodies_are_refused_with_the_reason(body: bytes, says: str) -> None:
    with pytest.raises(BadRewards) as caught:
        parse_rewards(body)
    assert says in str(caught.value)


# -- "unknown rollout" survives any interleaving and any batching ---------------------------


def _partition_stream(draw: st.DrawFn) -> list[Event]:
    """Lifecycle events and rewards of three rollouts in one rollouts partition's order."""
    out: list[Event] = []
    for _ in range(draw(st.integers(1, 12))):
        rid = draw(st.sampled_from(["r1", "r2", "r3"]))
        kind = draw(st.sampled_from(["started", "reward", "reward_attempt"]))
        if kind == "started":
            out.append(_started(rid, f"{rid}-a"))
        else:
            attempt = draw(st.sampled_from([f"{rid}-a", f"{rid}-b"]))
            out.append(_reward(rid, attempt if kind == "reward_attempt" else None))
    return out


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_the_same_rewards_are_refused_whatever_the_batches_and_other_topics(
    data: st.DataObject,
) -> None:
    """The projector's refusals depend on the rollouts partition's order only: any split into
    batches, and records of other topics (tasks, spans) anywhere between, refuse the same."""
    consumed = _consumed(data.draw(st.composite(_partition_stream)()))
    others = [
        ConsumedEvent(event, f"agl.{tp[0]}", 0, i, None)
        for i, (tp, event) in enumerate(one_call_attempt("r2", attempt_id="r2-a"))
        if tp[0] != "rollouts"  # its queued record and spans: on tasks and spans
    ]

    def refused_in(batches: list[list[ConsumedEvent]]) -> set[int]:
        state, out = State(), set()
        for batch in batches:
            out |= {item.offset for item, _, _ in refused_rewards(batch, state).values()}
            project([c.event for c in batch], state)  # what the next batch loads
        return out

    whole = refused_in([consumed])
    cuts = sorted(data.draw(st.sets(st.integers(1, len(consumed)), max_size=4)))
    bounds = list(zip([0, *cuts], [*cuts, len(consumed)], strict=True))
    batches = [consumed[a:b] for a, b in bounds]
    mixed = []
    for batch in batches:  # merged with the other topics' records, each side in its order
        rest, merged = list(others), []
        for item in batch:
            while rest and data.draw(st.booleans()):
                merged.append(rest.pop(0))
            merged.append(item)
        mixed.append(merged + rest)
    assert refused_in(batches) == whole
    assert refused_in(mixed) == whole


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_the_trainer_joins_the_same_late_reward_in_any_interleaving(data: st.DataObject) -> None:
    """A reward before the attempt's start (refused) and two after it (the first in the
    partition counts), with the tasks and spans records anywhere: the same trajectory and
    reward (a retrain, reading the topics in another interleaving, trains on the same)."""
    records, attempt = _attempt("r")
    at = datetime(2026, 11, 1, tzinfo=UTC)
    early = _late("r", None, 9.0, name="thumbs", given_at=at + timedelta(hours=1))
    first = _late("r", attempt, 0.25, name="thumbs", given_at=at)
    second = _late("r", None, 0.5, name="thumbs", given_at=at + timedelta(minutes=1))
    lifecycle = [r for r in records if r[0][0] == "rollouts"]
    lifecycle = [early, *lifecycle[:1], first, *lifecycle[1:], second]
    others = [r for r in records if r[0][0] != "rollouts"]
    merged, rest = [], list(others)
    for record in lifecycle:  # each side in its own order, merged at random
        while rest and data.draw(st.booleans()):
            merged.append(rest.pop(0))
        merged.append(record)
    merged += rest
    assembler = Assembler(late_reward=LateRewardRule("thumbs", 3600))
    ready = _feed(assembler, merged)
    assert len(ready) == 1
    assert ready[0].reward == 0.25 and ready[0].reward_from == "late"  # type: ignore[attr-defined]
    assert assembler.counts["late_rewards_refused"] == 1


def test_a_reward_from_the_future_is_refused_where_it_enters_and_where_it_is_read() -> None:
    with pytest.raises(BadReward, match="in the future"):
        make_reward("r1", 1.0, given_at=datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC))
    assert make_reward("r1", 1.0, given_at=datetime.now(UTC) + timedelta(minutes=4))
    # Written by a producer that does not check: refused against its record's time.
    future = RewardRecorded(
        rollout_id="r1", value=1.0, occurred_at=datetime(9999, 1, 1, tzinfo=UTC)
    )
    written_ms = int(datetime(2026, 11, 27, tzinfo=UTC).timestamp() * 1000)
    consumed = [
        ConsumedEvent(_started("r1", "a1"), "agl.rollouts", 0, 0, written_ms),
        ConsumedEvent(future, "agl.rollouts", 0, 1, written_ms),
    ]
    [(item, kind, reason)] = refused_rewards(consumed, State()).values()
    assert (item.event, kind) == (future, FUTURE_REWARD)
    assert "its record was written at 2026-11-27" in reason
    assembler = Assembler()
    assembler.add(("rollouts", 0), 0, _started("r1", "a1"), written_ms)
    assembler.add(("rollouts", 0), 1, future, written_ms)
    assert assembler.counts["late_rewards_refused"] == 1
