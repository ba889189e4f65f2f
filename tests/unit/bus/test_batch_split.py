"""Batch.split: the halves a projection applies in turn when the database refuses a record of
a batch. Together they are the batch, in order, and the first ends where the second starts."""

from __future__ import annotations

from aiokafka import TopicPartition
from hypothesis import given
from hypothesis import strategies as st

from agl_stream.bus.streams import Batch, ConsumedEvent, Converted
from agl_stream.events import WorkerHeartbeat

EVENT = WorkerHeartbeat(
    worker_id="w", role="runner", status="idle", hostname="h", pid=1, interval_seconds=5
)


@st.composite
def batches(draw: st.DrawFn) -> Batch:
    batch = Batch(dead_lettered=draw(st.integers(0, 3)))
    for p in range(draw(st.integers(1, 4))):
        tp = TopicPartition("agl.spans" if p % 2 else "agl.rollouts", p)
        start = draw(st.integers(0, 100))
        offsets = sorted(draw(st.sets(st.integers(start, start + 40), max_size=12)))
        kinds = [draw(st.booleans()) for _ in offsets]
        events = [
            ConsumedEvent(EVENT, tp.topic, p, o, None)
            for o, k in zip(offsets, kinds, strict=True)
            if k
        ]
        converted = [
            Converted(b"row", "SpanRecorded", o, None)
            for o, k in zip(offsets, kinds, strict=True)
            if not k
        ]
        if events:
            batch.events[tp] = events
        if converted:
            batch.converted[tp] = converted
        batch.first_offsets[tp] = start
        batch.next_offsets[tp] = start + 41
    return batch


def _records(batch: Batch) -> list[tuple[TopicPartition, int]]:
    out = [(tp, e.offset) for tp, items in batch.events.items() for e in items]
    out += [(tp, c.offset) for tp, items in batch.converted.items() for c in items]
    return sorted(out)


@given(batches())
def test_the_halves_are_the_batch_in_order(batch: Batch) -> None:
    if batch.records() < 2:
        return
    first, second = batch.split()
    assert first.records() >= 1 and second.records() >= 1
    assert sorted(_records(first) + _records(second)) == _records(batch)
    assert first.dead_lettered + second.dead_lettered == batch.dead_lettered
    for tp, end in batch.next_offsets.items():
        if tp in first.next_offsets and tp in second.next_offsets:  # one partition, cut
            cut = first.next_offsets[tp]
            assert second.first_offsets[tp] == cut and second.next_offsets[tp] == end
            assert first.first_offsets[tp] == batch.first_offsets[tp]
            assert all(o < cut for t, o in _records(first) if t == tp)
            assert all(o >= cut for t, o in _records(second) if t == tp)
        else:  # a partition goes whole to one half
            half = first if tp in first.next_offsets else second
            assert half.next_offsets[tp] == end
            assert half.first_offsets[tp] == batch.first_offsets[tp]


def test_without_records_advances_the_same_offsets() -> None:
    tp = TopicPartition("agl.rollouts", 0)
    batch = Batch(
        events={tp: [ConsumedEvent(EVENT, tp.topic, 0, 5, None)]},
        next_offsets={tp: 6}, first_offsets={tp: 5}, dead_lettered=1,
    )  # fmt: skip
    rest = batch.without_records()
    assert rest.records() == 0
    assert (rest.next_offsets, rest.first_offsets, rest.dead_lettered) == ({tp: 6}, {tp: 5}, 1)
