"""The runner's pure parts: offsets it may commit, retry decisions, and the ledger that keeps
a restarted or new owner from running finished work again."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agl_stream.events import (
    AttemptFinished,
    AttemptStatus,
    ErrorInfo,
    RolloutCancelled,
    RolloutFinished,
    RolloutMode,
    RolloutQueued,
    RolloutStatus,
)
from agl_stream.runner.ledger import Action, Ledger
from agl_stream.runner.offsets import PartitionProgress
from agl_stream.runner.policy import Finish, Requeue, decide, retry_event_id


def queued(
    n: int = 1, max_attempts: int = 3, retry: tuple[AttemptStatus, ...] = (AttemptStatus.FAILED,)
) -> RolloutQueued:
    return RolloutQueued(
        rollout_id="ro", attempt_number=n, input_json="{}", mode=RolloutMode.TRAIN,
        max_attempts=max_attempts, retry_condition=retry,
    )  # fmt: skip


def finished(n: int, status: AttemptStatus, attempt_id: str = "a") -> AttemptFinished:
    return AttemptFinished(
        rollout_id="ro", attempt_id=f"{attempt_id}{n}", attempt_number=n, worker_id="w",
        status=status, span_count=0,
    )  # fmt: skip


def test_commit_stops_at_the_lowest_unfinished_offset() -> None:
    p = PartitionProgress()
    for offset in (10, 11, 12):
        p.started(offset)
    p.finished(11)
    p.finished(12)
    assert p.commit_position() == 10
    p.finished(10)
    assert p.commit_position() == 13
    p.advance(20)  # records that needed no work
    assert p.commit_position() == 20


@given(st.lists(st.integers(0, 50), unique=True, min_size=1), st.data())
def test_commit_never_passes_an_unfinished_record(offsets: list[int], data: st.DataObject) -> None:
    p = PartitionProgress()
    for offset in sorted(offsets):
        p.started(offset)
    done = data.draw(st.sets(st.sampled_from(offsets)))
    for offset in done:
        p.finished(offset)
    position = p.commit_position()
    assert position is not None
    assert all(o >= position for o in offsets if o not in done)


def test_success_finishes() -> None:
    assert decide(queued(), "a1", AttemptStatus.SUCCEEDED, None) == Finish(
        RolloutStatus.SUCCEEDED, None
    )


def test_retryable_failure_requeues_with_a_deterministic_id() -> None:
    decision = decide(queued(1), "a1", AttemptStatus.FAILED, ErrorInfo(type="E", message="m"))
    assert isinstance(decision, Requeue)
    assert decision.queued.attempt_number == 2
    assert decision.queued.previous_attempt_id == "a1"
    assert decision.queued.event_id == retry_event_id("ro", 2)
    again = decide(queued(1), "a1", AttemptStatus.FAILED, None)
    assert isinstance(again, Requeue) and again.queued.event_id == decision.queued.event_id


def test_no_retry_when_exhausted_or_not_in_condition() -> None:
    error = ErrorInfo(type="E", message="boom")
    assert decide(queued(3), "a3", AttemptStatus.FAILED, error) == Finish(
        RolloutStatus.FAILED, error
    )
    timeout = decide(queued(1), "a1", AttemptStatus.TIMEOUT, None)
    assert isinstance(timeout, Finish) and timeout.status == RolloutStatus.FAILED
    assert timeout.error is not None and timeout.error.type == "timeout"


def test_ledger_runs_new_work_and_skips_finished_rollouts() -> None:
    ledger = Ledger()
    assert ledger.plan(queued(), set()).action is Action.RUN
    ledger.apply(RolloutFinished(rollout_id="ro", status=RolloutStatus.SUCCEEDED, attempt_count=1))
    assert ledger.plan(queued(), set()).action is Action.SKIP


def test_ledger_skips_a_duplicate_of_work_in_flight() -> None:
    assert Ledger().plan(queued(2), {("ro", 2)}).action is Action.SKIP


def test_an_attempt_known_to_have_ended_is_not_decided_again() -> None:
    """A new owner that finds attempt 1's end before it has read the retry record (a later
    record of the partition) must not publish a second retry: the retry committed with the
    end. (It used to; after one more takeover whose fold started past the rollout's end,
    the second retry record ran the rollout to success a second time.)"""
    ledger = Ledger()
    ledger.apply(finished(1, AttemptStatus.FAILED), offset=7)
    plan = ledger.plan(queued(1), set())
    assert (plan.action, plan.relies_on) == (Action.SKIP, 7)
    assert ledger.plan(queued(2), set()).action is Action.RUN


def test_ledger_reruns_an_attempt_that_started_but_never_finished() -> None:
    ledger = Ledger()
    ledger.apply(queued(2))
    ledger.apply(finished(1, AttemptStatus.FAILED))
    assert ledger.plan(queued(2), set()).action is Action.RUN


def test_cancel_before_start_and_cancel_after_the_end() -> None:
    ledger = Ledger()
    ledger.apply(RolloutCancelled(rollout_id="ro"))
    assert ledger.plan(queued(), set()).action is Action.CANCEL
    done = Ledger()
    done.apply(RolloutFinished(rollout_id="ro", status=RolloutStatus.SUCCEEDED, attempt_count=1))
    done.apply(RolloutCancelled(rollout_id="ro"))
    assert done.plan(queued(), set()).action is Action.SKIP


def test_a_plan_names_the_rollouts_offset_it_relies_on() -> None:
    ledger = Ledger()
    ledger.apply(finished(1, AttemptStatus.FAILED), offset=40)
    ledger.apply(finished(1, AttemptStatus.FAILED), offset=55)  # the same fact again, later
    attempt_plan = ledger.plan(queued(1), set())
    assert (attempt_plan.action, attempt_plan.relies_on) == (Action.SKIP, 40)  # the earliest
    ended = RolloutFinished(rollout_id="ro", status=RolloutStatus.FAILED, attempt_count=1)
    ledger.apply(ended, offset=70)
    skip = ledger.plan(queued(1), set())
    assert (skip.action, skip.relies_on) == (Action.SKIP, 70)
    assert Ledger().plan(queued(1), set()).relies_on is None  # RUN: its own first event


def test_the_checkpoint_folds_from_what_records_above_the_commit_rely_on() -> None:
    # Taken over at rollouts offset 100 when the tasks partition ended at 50; the fold read
    # up to 130.
    p = PartitionProgress(rollouts_end=130, inherited_from=100, inherited_until=50)
    p.started(48, relies_on=None)  # runs: what it writes lands at 130 or after
    p.started(49, relies_on=110)  # decided from an attempt's end at rollouts offset 110
    p.handled(50, relies_on=None)
    assert p.checkpoint() == (48, 100)  # 48 < 50: an earlier owner may have handled more
    p.wrote(131)
    p.finished(48)
    assert p.checkpoint() == (49, 100)
    p.finished(49)
    assert p.checkpoint() == (51, 132)  # everything handled: from the end of what was written
    p.started(51)  # relies on 132
    p.wrote(140)
    p.started(52)  # relies on 141
    assert p.checkpoint() == (51, 132)
    p.finished(51)
    assert p.checkpoint() == (52, 141)
    p.finished(52)
    assert p.checkpoint() == (53, 141)


@given(
    st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.booleans()), min_size=1, max_size=40),
    st.integers(0, 30),
    st.data(),
)
def test_no_record_above_the_commit_relies_on_anything_before_the_fold_start(
    records: list[tuple[bool, int, bool]], inherited_until: int, data: st.DataObject
) -> None:
    """Records handled in order (run, or planned from a fact up to 5 back from the end);
    events written at growing offsets; some records finish. Whatever the state, the next
    owner's fold starts at or before everything a record at or above the commit relies on,
    and at or before the inherited start while records an earlier owner handled may remain."""
    p = PartitionProgress(rollouts_end=1000, inherited_from=990, inherited_until=inherited_until)
    relied: dict[int, int] = {}
    end = 1000
    for offset, (runs, back, finishes) in enumerate(records):
        fact = None if runs else max(990, end - back)
        p.started(offset, relies_on=fact)
        relied[offset] = end if fact is None else fact  # a run relies on what it writes
        if data.draw(st.booleans()):
            p.wrote(end)
            end += 1
        if finishes:
            p.finished(offset)
    checkpoint = p.checkpoint()
    assert checkpoint is not None
    position, fold_from = checkpoint
    assert all(fold_from <= r for o, r in relied.items() if o >= position)
    assert fold_from <= end  # records with nothing written yet will write at or after it
    if position < inherited_until:
        assert fold_from <= 990


def test_the_ledger_forgets_finished_rollouts_once_their_records_are_committed() -> None:
    ledger = Ledger()
    ended = RolloutFinished(rollout_id="ro", status=RolloutStatus.SUCCEEDED, attempt_count=1)
    ledger.apply(ended, offset=10)
    ledger.planned("ro", 5)
    ledger.apply(finished(1, AttemptStatus.FAILED).model_copy(update={"rollout_id": "retry"}))
    ledger.planned("retry", 3)  # its retry record is still to come: not finished
    assert ledger.prune(5) == 0  # the record at 5 is not below the commit yet
    assert ledger.prune(6) == 1
    assert set(ledger.rollouts) == {"retry"}
    # A finished rollout known only from the fold (no record of it planned) goes too.
    ledger.apply(ended.model_copy(update={"rollout_id": "old"}), offset=2)
    assert ledger.prune(0) == 1


def test_a_cancel_of_a_forgotten_rollout_is_forgotten_too_once_committed() -> None:
    ledger = Ledger()
    ledger.apply(RolloutCancelled(rollout_id="gone"))  # read ahead by the cancel watch
    assert ledger.prune(100) == 0  # the loop has not read it: kept
    ledger.planned("gone", 40)  # the loop read the cancel record at 40
    assert ledger.prune(40) == 0
    assert ledger.prune(41) == 1
    # A cancel after an attempt ended (its retry may be a later record) stays.
    ledger.apply(finished(1, AttemptStatus.FAILED), offset=3)
    ledger.apply(RolloutCancelled(rollout_id="ro"))
    ledger.planned("ro", 5)
    assert ledger.prune(6) == 0
