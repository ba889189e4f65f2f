"""The store facade's live state in memory (agl_stream.compat.agl.live): the queue's order, the
running set, and what may be forgotten (no broker, no database)."""

from __future__ import annotations

from agl_stream.compat.agl import records as logic
from agl_stream.compat.agl.live import Live, RolloutState, committed, projected_past
from agl_stream.compat.agl.reads import sort_key
from agl_stream.compat.agl.records import AttemptRecord, RolloutRecord

from agentlightning.types import Attempt, Rollout  # isort: skip  (after agl_stream.compat.agl)

PLACE = ("p-rollouts", 0)


def _queued(rid: str, at: float) -> RolloutRecord:
    rollout = Rollout(rollout_id=rid, input={}, start_time=at, status="queuing")
    return RolloutRecord(rollout, revision=1, created_at=at, queued_at=at)


def _attempt(rid: str, aid: str, seq: int) -> AttemptRecord:
    return AttemptRecord(
        Attempt(rollout_id=rid, attempt_id=aid, sequence_id=seq, start_time=0.0), revision=1
    )


def test_the_queue_is_fifo_and_a_claimed_rollout_leaves_it() -> None:
    live = Live()
    for i, at in enumerate([3.0, 1.0, 2.0]):
        live.put_rollout(_queued(f"ro-{i}", at))
    assert [s.rollout.rollout_id for s in live.queued(10)] == ["ro-1", "ro-2", "ro-0"]
    assert [s.rollout.rollout_id for s in live.queued(2)] == ["ro-1", "ro-2"]  # still queued
    claimed = logic.with_rollout_status(live.rollouts["ro-1"].record, "preparing", 4.0)
    live.put_rollout(claimed)
    assert [s.rollout.rollout_id for s in live.queued(10)] == ["ro-2", "ro-0"]
    assert live.running == {"ro-1"} and live.queue_length() == 2


def test_a_requeued_rollout_goes_to_the_tail_once() -> None:
    live = Live()
    live.put_rollout(_queued("a", 1.0))
    live.put_rollout(_queued("b", 2.0))
    a = logic.with_rollout_status(live.rollouts["a"].record, "running", 3.0)
    live.put_rollout(a)
    requeued = logic.with_rollout_status(a, "requeuing", 4.0)
    live.put_rollout(requeued)
    live.put_rollout(logic.updated_rollout(requeued, 5.0, {"metadata": {"k": 1}}))  # same place
    assert [s.rollout.rollout_id for s in live.queued(10)] == ["b", "a"]
    assert live.running == set()


def test_the_latest_attempt_is_the_highest_sequence_id() -> None:
    live = Live()
    live.put_rollout(_queued("a", 1.0))
    live.put_attempt(_attempt("a", "at-2", 2))
    live.put_attempt(_attempt("a", "at-1", 1))
    state = live.rollouts["a"]
    latest = state.latest()
    assert latest is not None and latest.attempt.attempt_id == "at-2"
    assert state.spans["at-1"].ids == set()  # a new attempt has no spans to look up
    assert state.attempted().attempt.attempt_id == "at-2"  # type: ignore[attr-defined]


def test_a_finishing_rollout_moves_the_finished_version() -> None:
    live = Live()
    live.put_rollout(_queued("a", 1.0))
    before = live.finished_version
    done = logic.with_rollout_status(live.rollouts["a"].record, "succeeded", 2.0)
    live.put_rollout(done)
    live.put_rollout(logic.updated_rollout(done, 3.0, {"metadata": {}}))  # finished already
    assert live.finished_version == before + 1


def test_only_finished_projected_settled_rollouts_are_forgotten() -> None:
    live = Live(kept=1)
    for rid, at in [("done", 1.0), ("unprojected", 2.0), ("staged", 3.0), ("queued", 4.0)]:
        state = live.put_rollout(_queued(rid, at))
        state.in_flight += 1
        committed(state, {PLACE: int(at)})
        if rid != "queued":
            live.put_rollout(logic.with_rollout_status(state.record, "succeeded", at))
    live.rollouts["staged"].in_flight += 1  # a write not yet committed
    assert live.over()
    assert live.evict({PLACE: 2}) == 1  # offsets 0 and 1 projected: "done" (offset 1) only
    assert set(live.rollouts) == {"unprojected", "staged", "queued"}
    assert live.evict({PLACE: 100}) == 1  # "staged" waits for its commit; "queued" is live
    assert set(live.rollouts) == {"staged", "queued"}


def test_projected_past_needs_every_place() -> None:
    assert projected_past({("t", 0): 4, ("t", 1): 0}, {("t", 0): 5, ("t", 1): 1})
    assert not projected_past({("t", 0): 4}, {("t", 0): 4})
    assert not projected_past({("t", 2): 0}, {("t", 0): 9})
    assert projected_past({}, {})


def test_sort_keys_follow_the_read_models_order() -> None:
    started = sort_key(Rollout, "end_time")
    a = Rollout(rollout_id="a", input={}, start_time=1.0, end_time=None)
    b = Rollout(rollout_id="b", input={}, start_time=1.0, end_time=5.0)
    assert sorted([a, b], key=started) == [b, a]  # a missing *_time sorts last
    by_mode = sort_key(Rollout, "mode")
    assert by_mode(a) == ""  # a missing text as ""


def test_a_state_made_new_knows_its_sequence_floor() -> None:
    live = Live()
    state = live.put_rollout(_queued("a", 1.0))
    assert isinstance(state, RolloutState) and state.sequence_floor == 0
    loaded = live.hold(RolloutState(_queued("b", 2.0)))
    assert loaded.sequence_floor is None  # to be read from the read model when asked
