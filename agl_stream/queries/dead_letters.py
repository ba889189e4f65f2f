"""Reading the dead-letter topic back: the newest dead letters with their reasons."""

from __future__ import annotations

from aiokafka import TopicPartition

from agl_stream.bus.dead_letters import DeadLetterView
from agl_stream.bus.kafka import end_offsets
from agl_stream.bus.streams import read_records
from agl_stream.runtime.config import KafkaSettings


async def read_dead_letters(settings: KafkaSettings, limit: int) -> list[DeadLetterView]:
    """The newest `limit` dead letters, oldest first."""
    tp = TopicPartition(settings.topic("dlq"), 0)
    ends = await end_offsets(settings, [tp])
    return [
        DeadLetterView.parse(record.headers or (), record.value, record.offset)
        async for record in read_records(settings, {tp: max(ends[tp] - limit, 0)}, ends)
    ]
