"""Assembling trajectories from records in any interleaving, and resuming from a cut."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from agl_stream.events import AttemptFinished, AttemptStatus, RolloutMode
from agl_stream.training.trajectories import Assembler, Trajectory
from tests.support.training_traffic import (
    Record,
    attempt_records,
    llm_span,
    one_call_attempt,
    reward_span,
    run_all,
    with_offsets,
)


def traffic(seed: int) -> list[Record]:
    """Train rollouts (some retried after a failure, some with an attempt abandoned by a
    killed runner, some run to success twice: a runner cut off from the broker finished an
    attempt another runner had taken over), a validation rollout, spread over partitions 0
    and 1."""
    rng = random.Random(seed)
    out: list[Record] = []
    for i in range(8):
        rid = f"r{i}"
        kind = rng.choice(["plain", "retried", "abandoned", "twice"])
        if kind == "retried":
            out += attempt_records(
                rid, [], status=AttemptStatus.FAILED, reward=None, finish_rollout=False
            )
            out += one_call_attempt(rid, group=f"g{i % 3}", attempt_number=2)
        elif kind == "abandoned":
            dead = attempt_records(rid, [llm_span(rid, "dead", 0, 5, [1], [2])], attempt_id="dead")
            out += dead[:3]  # queued, started, one span: then the runner was killed
            out += one_call_attempt(rid, group=f"g{i % 3}")[1:]
        elif kind == "twice":
            first = one_call_attempt(rid, group=f"g{i % 3}", reward=0.5)
            second = one_call_attempt(rid, group=f"g{i % 3}", reward=0.25)
            out += first[:2] + second[1:3] + first[2:] + second[3:]
        else:
            out += one_call_attempt(rid, group=f"g{i % 3}", reward=rng.random())
    out += one_call_attempt("val", mode=RolloutMode.VAL)
    # Spread rollouts over two partitions, as their keys would.
    return [((tp[0], _partition(event)), event) for tp, event in out]


def _partition(event: object) -> int:
    rollout_id = str(getattr(event, "rollout_id", ""))
    return int(rollout_id[-1]) % 2 if rollout_id[-1:].isdigit() else 0


def succeeded_keys(records: list[Record]) -> set[tuple[str, str]]:
    return {
        (e.rollout_id, e.attempt_id)  # type: ignore[attr-defined]
        for _, e in records
        if type(e).__name__ == "AttemptFinished"
        and e.status == AttemptStatus.SUCCEEDED  # type: ignore[attr-defined]
        and e.rollout_id != "val"  # type: ignore[attr-defined]
    }


def assert_one_success_per_rollout(got: list[tuple[str, str]], records: list[Record]) -> None:
    """Every rollout with a success is trained on once, with one of its successes."""
    succeeded = succeeded_keys(records)
    assert set(got) <= succeeded
    assert sorted(r for r, _ in got) == sorted({r for r, _ in succeeded})


def interleave(records: list[Record], rng: random.Random) -> list[Record]:
    """Any merge of the partitions that keeps each partition's order."""
    queues: dict[tuple[str, int], list[Record]] = {}
    for record in records:
        queues.setdefault(record[0], []).append(record)
    out = []
    while queues:
        tp = rng.choice(sorted(queues))
        out.append(queues[tp].pop(0))
        if not queues[tp]:
            del queues[tp]
    return out


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), order=st.integers(0, 10_000), duplicate=st.booleans())
def test_every_successful_train_attempt_once_in_any_order(
    seed: int, order: int, duplicate: bool
) -> None:
    records = traffic(seed)
    shuffled = interleave(records, random.Random(order))
    if duplicate:  # at-least-once delivery: some records come twice, later
        rng = random.Random(order + 1)
        shuffled += [r for r in shuffled if rng.random() < 0.3]
    assembler = Assembler()
    got = run_all(assembler, shuffled)
    assert_one_success_per_rollout([t.key for t in got], records)
    for t in got:
        assert [s.sequence for s in t.spans] == list(range(len(t.spans)))
    # Everything settled: nothing pending holds the cut back.
    assert not assembler.pending
    positions = {("spans", 0): 10_000}
    assert assembler.cut(positions) == positions


def test_span_before_its_attempt_started_and_finish_before_last_span() -> None:
    records = one_call_attempt("r1")
    queued, started, call, reward, finished, end = records
    assembler = Assembler()
    got = run_all(assembler, [reward, finished, end, queued, started])
    assert got == []
    got = run_all(assembler, [call])
    assert [t.key for t in got] == [("r1", started[1].attempt_id)]  # type: ignore[attr-defined]
    assert got[0].reward == 1.0 and got[0].group == "g"


def test_validation_rollouts_and_failed_attempts_are_counted_not_trained() -> None:
    assembler = Assembler()
    records = one_call_attempt("v", mode=RolloutMode.VAL) + attempt_records(
        "f", [], status=AttemptStatus.FAILED, reward=None
    )
    assert run_all(assembler, records) == []
    assert assembler.counts["rollouts_not_train"] == 1
    assert assembler.counts["attempts_failed"] == 1
    assert not assembler.pending


def test_a_rollout_waiting_for_its_group_holds_the_cut() -> None:
    assembler = Assembler()
    records = with_offsets(one_call_attempt("r1"))
    for tp, offset, event in records:
        assembler.add(tp, offset, event)
    [trajectory] = assembler.complete()  # handed out, not yet trained on
    positions = {("tasks", 0): 1, ("rollouts", 0): 3, ("spans", 0): 2}
    assert assembler.cut(positions) == {("tasks", 0): 0, ("rollouts", 0): 0, ("spans", 0): 0}
    assembler.settle([trajectory.key])
    assert assembler.cut(positions) == positions


def test_a_finished_rollout_missing_a_span_is_given_up_after_patience() -> None:
    assembler = Assembler(patience_records=3)
    records = one_call_attempt("r1")
    lost_span = records.pop(2)
    assert lost_span[1].name == "agl.llm.call"  # type: ignore[attr-defined]
    run_all(assembler, records)
    assert "r1" in assembler.pending
    for i in range(4):
        run_all(assembler, one_call_attempt(f"other{i}"))
    assembler.cut({})
    assert "r1" not in assembler.pending
    assert assembler.counts["attempts_incomplete"] == 1


def test_late_spans_of_a_forgotten_rollout_do_not_hold_the_cut_for_ever() -> None:
    """A runner cut off from the broker commits an attempt's spans after another runner
    finished the rollout and the assembler forgot it (pruned below the cut): those spans
    alone make a rollout that is never queued nor ended, which held the cut for ever (and
    with it the pruning of all that was settled above it). The hour's soak saw a trainer's
    cut stop on three spans partitions only, and its memory of settled rollouts grow from
    2,600 to 52,000: this is the one way found for that to happen."""
    assembler = Assembler(patience_records=3)
    assert len(run_all(assembler, one_call_attempt("r1"))) == 1  # trained on
    everything = {("tasks", 0): 100, ("rollouts", 0): 100, ("spans", 0): 100}
    assembler.prune(assembler.cut(everything))
    assert "r1" not in assembler.settled_rollouts  # forgotten
    late = [e for (topic, _), e in one_call_attempt("r1", attempt_id="zombie") if topic == "spans"]
    for offset, event in enumerate(late, start=100):
        assembler.add(("spans", 0), offset, event)
    assert assembler.cut({("spans", 0): 200})[("spans", 0)] == 100  # held, for now
    for i in range(2):
        run_all(assembler, one_call_attempt(f"other{i}"))
    assert assembler.cut({("spans", 0): 200}) == {("spans", 0): 200}  # let go
    assert assembler.counts["rollouts_orphaned"] == 1
    assert assembler.counts["attempts_orphaned"] == 1
    assert assembler.complete() == []  # never trained on


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), stop=st.floats(0, 1), train_every=st.integers(1, 5))
def test_resuming_from_the_cut_neither_repeats_nor_loses(
    seed: int, stop: float, train_every: int
) -> None:
    """A trainer that settles trajectories in steps, is killed after a step, and resumes
    from that step's cut and memory, trains on exactly the attempts of an uninterrupted run."""
    records = interleave(traffic(seed), random.Random(seed))
    offsets = with_offsets(records)
    first = Assembler()
    used: list[tuple[str, str]] = []
    waiting: list[Trajectory] = []
    positions: dict[tuple[str, int], int] = {}
    cut: dict[tuple[str, int], int] = {}
    memory = first.memory()
    kill_at = int(len(offsets) * stop)
    for n, (tp, offset, event) in enumerate(offsets[:kill_at]):
        first.add(tp, offset, event)
        positions[tp] = offset + 1
        waiting += first.complete()
        if (n + 1) % train_every == 0 and waiting:
            first.settle(t.key for t in waiting)
            used += [t.key for t in waiting]
            waiting = []
            cut = first.cut(positions)
            first.prune(cut)
            memory = first.memory()
            checkpoint_used = list(used)
    if not cut:
        checkpoint_used, cut = [], {}
    # Killed: what was not in a checkpoint is lost; resume from the last one.
    second = Assembler.resume(memory)
    rest = [(tp, o, e) for tp, o, e in offsets if o >= cut.get(tp, 0)]
    more: list[Trajectory] = []
    for tp, offset, event in rest:
        second.add(tp, offset, event)
        ready = second.complete()
        second.settle(t.key for t in ready)
        more += ready
    total = checkpoint_used + [t.key for t in more]
    assert_one_success_per_rollout(total, records)


def test_memory_round_trips_through_json() -> None:
    import json

    assembler = Assembler()
    run_all(assembler, one_call_attempt("r1") + one_call_attempt("v", mode=RolloutMode.VAL))
    memory = json.loads(json.dumps(assembler.memory()))
    again = Assembler.resume(memory)
    assert again.settled_rollouts == assembler.settled_rollouts
    assert again.settled_attempts == assembler.settled_attempts


def test_reward_from_the_last_reward_span_when_the_attempt_has_none() -> None:
    rid, aid = "r1", "a1"
    spans = [llm_span(rid, aid, 0, 1, [1], [2]), reward_span(rid, aid, 1, 2, 0.25)]
    [t] = run_all(Assembler(), attempt_records(rid, spans, attempt_id=aid, reward=None))
    assert t.reward == 0.25


def test_spans_numbered_by_their_ids_are_whole_when_all_are_there_in_the_order_they_started() -> (
    None
):
    # An ingested attempt's sequences are its spans' ids (agl_stream.otlp.mapping).
    rid, aid = "r1", "otlp-a"
    late, early, reward = (
        llm_span(rid, aid, 9_000_001, 20, [1], [2]),
        llm_span(rid, aid, 7_345, 10, [3], [4]),
        reward_span(rid, aid, 123_456_789, 30, 0.5),
    )
    records = attempt_records(rid, [late, early, reward], attempt_id=aid, reward=None)
    finish_at = next(i for i, (_, e) in enumerate(records) if isinstance(e, AttemptFinished))
    missing_one = [r for r in records if r[1] is not reward]
    assert run_all(Assembler(), missing_one) == []  # 2 of its 3 spans: not whole yet
    [t] = run_all(Assembler(), records[: finish_at + 1])
    assert [s.sequence for s in t.spans] == [7_345, 9_000_001, 123_456_789]
    assert t.reward == 0.5
