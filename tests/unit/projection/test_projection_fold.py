"""The fold from events to rows is order-free and idempotent: any interleaving of the
topics, any split into batches and any duplicate delivery give the same rows."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_stream.events import Event
from agl_stream.projection.fold import Changes, State, keys, project
from agl_stream.projection.rows import SpanRow, evolve
from tests.support.traffic import traffic


@dataclass
class FakeTables:
    """What the projector's SQL does with Changes, on dicts: upsert rows, insert spans when
    absent."""

    state: State = field(default_factory=State)
    spans: dict[tuple[str, str, int], SpanRow] = field(default_factory=dict)

    def apply(self, events: list[Event]) -> None:
        wanted = keys(events)
        loaded = State(
            rollouts={k: v for k, v in self.state.rollouts.items() if k in wanted.rollouts},
            attempts={k: v for k, v in self.state.attempts.items() if k[0] in wanted.rollouts},
            resources={k: v for k, v in self.state.resources.items() if k in wanted.resources},
            workers={k: v for k, v in self.state.workers.items() if k in wanted.workers},
        )
        self.write(project(events, loaded))

    def write(self, changes: Changes) -> None:
        for r in changes.rollouts:
            self.state.rollouts[r.rollout_id] = r
        for a in changes.attempts:
            self.state.attempts[(a.rollout_id, a.attempt_id)] = a
        for res in changes.resources:
            self.state.resources[res.resources_id] = res
        for w in changes.workers:
            self.state.workers[w.worker_id] = w
        for s in changes.spans:
            self.spans.setdefault((s.rollout_id, s.attempt_id, s.sequence), s)


def fold_in_order(events: list[Event]) -> FakeTables:
    tables = FakeTables()
    tables.apply(events)
    return tables


EVENTS = [event for _, event in traffic(seed=7, rollouts=12)]
EXPECTED = fold_in_order(EVENTS)


@settings(max_examples=60, deadline=None)
@given(st.randoms(use_true_random=False), st.integers(1, 40), st.floats(0, 1))
def test_any_order_batches_and_duplicates_give_the_same_rows(
    rng: random.Random, batch: int, duplicate: float
) -> None:
    events = EVENTS + [e for e in EVENTS if rng.random() < duplicate]
    rng.shuffle(events)
    tables = FakeTables()
    for start in range(0, len(events), batch):
        tables.apply(events[start : start + batch])
    assert tables.state == EXPECTED.state
    assert tables.spans == EXPECTED.spans


def test_applying_a_batch_again_changes_nothing() -> None:
    tables = fold_in_order(EVENTS)
    wanted = keys(EVENTS)
    loaded = State(
        rollouts=dict(tables.state.rollouts),
        attempts=dict(tables.state.attempts),
        resources=dict(tables.state.resources),
        workers=dict(tables.state.workers),
    )
    changes = project(EVENTS, loaded)
    assert wanted.rollouts
    assert not changes.rollouts and not changes.attempts
    assert not changes.resources and not changes.workers


def test_statuses_follow_the_lifecycle() -> None:
    rows = EXPECTED.state.rollouts
    assert {r.status for r in rows.values()} <= {"succeeded", "cancelled"}
    assert any(r.attempt_count > 1 for r in rows.values())
    for rollout in rows.values():
        attempts = [a for (r, _), a in EXPECTED.state.attempts.items() if r == rollout.rollout_id]
        assert rollout.attempt_count == len(attempts)
        if rollout.status == "succeeded":
            final = [a for a in attempts if a.attempt_id == rollout.latest_attempt_id]
            assert final and final[0].status == "succeeded"
            assert rollout.reward == final[0].reward


def test_a_span_before_its_attempt_and_a_finish_before_its_spans() -> None:
    """The worst cross-topic order: spans first, then the finish, then the start."""
    spans = [e for e in EVENTS if type(e).__name__ == "SpanRecorded"]
    lifecycle = [e for e in EVENTS if type(e).__name__ != "SpanRecorded"]
    tables = FakeTables()
    tables.apply(spans)
    for event in reversed(lifecycle):
        tables.apply([event])
    assert tables.state == EXPECTED.state and tables.spans == EXPECTED.spans


def test_a_running_rollout_and_one_waiting_for_its_retry() -> None:
    rollout = [
        e for _, e in traffic(seed=3, rollouts=40) if getattr(e, "rollout_id", "") == "ro-00001"
    ]
    names = [type(e).__name__ for e in rollout]
    started = names.index("AttemptStarted")
    tables = fold_in_order(rollout[: started + 1])
    assert tables.state.rollouts["ro-00001"].status == "running"
    tables = fold_in_order(rollout[:1])
    assert tables.state.rollouts["ro-00001"].status == "queuing"


def test_evolve_is_dataclasses_replace() -> None:
    tables = fold_in_order(EVENTS)
    rows = [*tables.state.rollouts.values(), *tables.state.attempts.values()]
    for row in rows:
        changes = {"status": "x", "worker_id": "w9"}
        assert evolve(row, **changes) == dataclasses.replace(row, **changes)
        assert evolve(row) == row and evolve(row) is not row
    with pytest.raises(TypeError, match="no fields"):
        evolve(rows[0], colour="blue")
