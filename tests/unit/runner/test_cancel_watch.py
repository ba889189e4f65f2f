"""The runner's cancel watch without a broker: which records it decodes, where it reads each
partition from as the runner's partitions change, and that a read made across a change
hands nothing on."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from agl_stream.bus.codec import Codec
from agl_stream.bus.streams import EVENT_TYPE_HEADER
from agl_stream.events import Event, RolloutCancelled, RolloutMode, RolloutQueued
from agl_stream.runner.cancel_watch import CancelWatch, cancel_in

P0 = TopicPartition("agl.tasks", 0)
P1 = TopicPartition("agl.tasks", 1)
CODEC = Codec()


def queued(rollout_id: str) -> RolloutQueued:
    return RolloutQueued(
        rollout_id=rollout_id, attempt_number=1, input_json="{}", mode=RolloutMode.TRAIN
    )


def record(
    tp: TopicPartition, offset: int, event: Event | None, value: bytes | None = None,
    header: str | None = "auto",
) -> ConsumerRecord:  # fmt: skip
    if header == "auto":
        header = event.type_name() if event is not None else None
    headers = [] if header is None else [(EVENT_TYPE_HEADER, header.encode())]
    body = value if value is not None else CODEC.encode(event) if event is not None else None
    return ConsumerRecord(
        tp.topic, tp.partition, offset, 0, 0, b"k", body, None, 1, len(body or b""), headers
    )


class CountingCodec(Codec):
    def __init__(self) -> None:
        super().__init__()
        self.decoded = 0

    def decode(self, data: bytes | None) -> Event:
        self.decoded += 1
        return super().decode(data)


def test_only_cancels_are_decoded() -> None:
    codec = CountingCodec()
    cancel = RolloutCancelled(rollout_id="ro-1", reason="stop")
    assert cancel_in(record(P0, 0, cancel), codec) == cancel
    assert codec.decoded == 1
    # Queued rollouts, the bulk of the topic, are told apart by their header alone.
    assert cancel_in(record(P0, 1, queued("ro-2")), codec) is None
    assert cancel_in(record(P0, 2, None, b"not avro", header="RolloutQueued"), codec) is None
    assert codec.decoded == 1
    # No header: the schema fingerprint names the type.
    assert cancel_in(record(P0, 3, cancel, header=None), codec) == cancel
    assert cancel_in(record(P0, 4, queued("ro-3"), header=None), codec) is None
    # A cancel that does not decode is left to the runner's consumer (it dead-letters it).
    assert (
        cancel_in(record(P0, 5, None, b"\xc3\x01garbage", header="RolloutCancelled"), codec) is None
    )
    assert codec.decoded == 3


def test_take_hands_on_the_cancels_of_watched_partitions_and_moves_past_them() -> None:
    got: list[tuple[TopicPartition, str]] = []
    watch = CancelWatch(lambda tp, event: got.append((tp, event.rollout_id)))
    watch.add(P0, 10)
    records = {
        P0: [
            record(P0, 10, queued("a")),
            record(P0, 11, RolloutCancelled(rollout_id="a")),
            record(P0, 12, queued("b")),
        ],
        P1: [record(P1, 0, RolloutCancelled(rollout_id="c"))],  # not watched
    }
    assert watch.take(records) == 1
    assert got == [(P0, "a")]
    assert watch.positions == {P0: 13}
    version = watch.version
    watch.drop([P1])  # not watched: no change
    assert watch.version == version
    watch.drop([P0, P1])
    assert watch.positions == {} and watch.version == version + 1


class FakeReader:
    """A group-less consumer over fixed partitions: assign() forgets every position, as
    aiokafka's does."""

    def __init__(self, log: dict[TopicPartition, list[ConsumerRecord]]) -> None:
        self.log = log
        self.positions: dict[TopicPartition, int] = {}
        self.assignments: list[dict[TopicPartition, int]] = []
        self.reads = 0
        self.while_reading: Callable[[], None] | None = None

    def assign(self, partitions: list[TopicPartition]) -> None:
        self.positions = dict.fromkeys(partitions, 0)
        self.assignments.append({})

    def seek(self, partition: TopicPartition, offset: int) -> None:
        assert partition in self.positions, "seek of a partition not assigned"
        self.positions[partition] = offset
        self.assignments[-1][partition] = offset

    async def getmany(
        self, *partitions: TopicPartition, timeout_ms: int = 0
    ) -> dict[TopicPartition, list[ConsumerRecord]]:
        self.reads += 1
        out: dict[TopicPartition, list[ConsumerRecord]] = {}
        for tp, position in self.positions.items():
            records = [r for r in self.log.get(tp, []) if r.offset >= position]
            if records:
                out[tp] = records
                self.positions[tp] = records[-1].offset + 1
        hook, self.while_reading = self.while_reading, None
        if hook is not None:
            hook()
        await asyncio.sleep(0.001)
        return out


async def _ticks(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0.002)


async def test_follow_keeps_its_place_as_partitions_come_and_go() -> None:
    got: list[tuple[TopicPartition, str]] = []
    watch = CancelWatch(lambda tp, event: got.append((tp, event.rollout_id)))
    reader = FakeReader(
        {
            P0: [record(P0, 0, queued("a")), record(P0, 1, RolloutCancelled(rollout_id="a"))],
            P1: [
                record(P1, 0, RolloutCancelled(rollout_id="below-the-commit")),
                record(P1, 1, RolloutCancelled(rollout_id="b")),
            ],
        }
    )
    follow = asyncio.create_task(watch.follow_with(reader, poll_ms=1))
    try:
        await _ticks()
        assert reader.reads == 0  # nothing to watch: it waits, it does not poll
        watch.add(P0, 0)
        await _ticks()
        assert got == [(P0, "a")]
        assert watch.positions == {P0: 2}

        # A new partition is read from its start; the one kept goes on where it was (the
        # assignment is replaced, so it is sought again), and its cancel is not repeated.
        watch.add(P1, 1)
        await _ticks()
        assert got == [(P0, "a"), (P1, "b")]
        assert reader.assignments[-1] == {P0: 2, P1: 1}

        # What a read brings after the partitions changed under it is not handed on: P1 was
        # handed back (its ledger gone), P0 is read again from where the watch was.
        reader.log[P0].append(record(P0, 2, RolloutCancelled(rollout_id="late")))
        reader.log[P1].append(record(P1, 2, RolloutCancelled(rollout_id="gone")))
        reader.while_reading = lambda: watch.drop([P1])
        await _ticks()
        assert got == [(P0, "a"), (P1, "b"), (P0, "late")]
        assert reader.assignments[-1] == {P0: 2}
        assert watch.positions == {P0: 3}

        watch.drop([P0])
        await _ticks()
        reads = reader.reads
        await _ticks()
        assert reader.reads == reads and reader.assignments[-1] == {}
    finally:
        follow.cancel()
        await asyncio.gather(follow, return_exceptions=True)


async def test_started_again_it_goes_on_from_the_positions_kept() -> None:
    got: list[str] = []
    watch = CancelWatch(lambda tp, event: got.append(event.rollout_id))
    watch.add(P0, 0)
    log = {P0: [record(P0, 0, RolloutCancelled(rollout_id="a"))]}
    first = asyncio.create_task(watch.follow_with(FakeReader(log), poll_ms=1))
    await _ticks()
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    log[P0].append(record(P0, 1, RolloutCancelled(rollout_id="b")))
    again = FakeReader(log)
    second = asyncio.create_task(watch.follow_with(again, poll_ms=1))
    await _ticks()
    second.cancel()
    await asyncio.gather(second, return_exceptions=True)
    assert got == ["a", "b"]
    assert again.assignments[0] == {P0: 1}
