"""A stream's batches say where its reader stands even when a fetch moved it past no record
at all: an aborted transaction (its records and its marker) at the end of a partition. A
reader that kept the offset of the last record it was handed would stay short of the end
for good (a lag that never closes, a projector that never catches up)."""

from __future__ import annotations

import uuid

from aiokafka import TopicPartition

from agl_stream.bus.kafka import consumer, end_offsets, producer
from agl_stream.bus.streams import EventPublisher, EventStream, Topics
from agl_stream.events import RolloutMode, RolloutQueued
from agl_stream.runtime.config import KafkaSettings
from tests.support.helpers import eventually


def queued(n: int) -> RolloutQueued:
    return RolloutQueued(
        rollout_id=f"ro-{n}", attempt_number=1, input_json="{}", mode=RolloutMode.TRAIN
    )


async def test_a_reader_past_an_aborted_transaction_says_where_it_stands(
    kafka: KafkaSettings,
) -> None:
    topics = Topics(kafka)
    tps = [TopicPartition(topics.name("tasks"), p) for p in range(topics.specs["tasks"].partitions)]
    async with (
        producer(kafka, transactional_id=f"t-{uuid.uuid4().hex[:6]}") as prod,
        consumer(kafka, group_id=f"g-{uuid.uuid4().hex[:6]}") as reader,
    ):
        reader.assign(tps)
        stream = EventStream(reader, None, topics, "test")
        publisher = EventPublisher(prod, topics)
        seen: list[str] = []
        positions: dict[TopicPartition, int] = {}

        async def read_to(ends: dict[TopicPartition, int]) -> bool:
            batch = await stream.next_batch(timeout_ms=200)
            seen.extend(c.event.rollout_id for c in batch)  # type: ignore[attr-defined]
            positions.update(batch.next_offsets)
            return all(positions.get(tp, 0) >= end for tp, end in ends.items() if end)

        async with prod.transaction():
            await publisher.publish("tasks", queued(1))
        ends = await end_offsets(kafka, tps)
        await eventually(lambda: read_to(ends), 30, "the committed record")
        await prod.begin_transaction()
        await publisher.publish("tasks", queued(2))
        await prod.abort_transaction()
        moved = {tp: end for tp, end in (await end_offsets(kafka, tps)).items() if end != ends[tp]}
        assert moved  # the aborted record and its marker
        await eventually(lambda: read_to(moved), 30, f"the reader's positions to reach {moved}")
        assert seen == ["ro-1"]
