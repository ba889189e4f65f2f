"""Which offsets an offline retrain reads: per partition of the trained topics, from a start
offset (default: the beginning) to an end offset (default: the end now). Time bounds are
applied to the records' broker timestamps as they are read (TrainerConfig.from_time and
until_time), so the range is the same whatever a broker's time index answers."""

from __future__ import annotations

from collections.abc import Mapping

from aiokafka import TopicPartition

from agl_stream.bus.kafka import consumer, end_offsets
from agl_stream.bus.streams import Topics
from agl_stream.runtime.config import KafkaSettings
from agl_stream.training.trajectories import TRAINED_TOPICS
from agl_stream.training.trajectories import TopicPartition as TP


async def resolve_range(
    kafka: KafkaSettings, starts: Mapping[TP, int], ends: Mapping[TP, int]
) -> tuple[dict[TP, int], dict[TP, int]]:
    topics = Topics(kafka)
    tps = [(t, p) for t in TRAINED_TOPICS for p in range(topics.specs[t].partitions)]
    full = {tp: TopicPartition(topics.name(tp[0]), tp[1]) for tp in tps}
    last = await end_offsets(kafka, full.values())
    async with consumer(kafka) as client:
        first = await client.beginning_offsets(list(full.values()))
    start = {tp: max(starts.get(tp, 0), first[full[tp]]) for tp in tps}
    until = {tp: min(ends.get(tp, last[full[tp]]), last[full[tp]]) for tp in tps}
    for tp in tps:
        if until[tp] < start[tp]:
            raise ValueError(
                f"{tp[0]}:{tp[1]}: the range ends at {until[tp]}, before it starts at {start[tp]}"
            )
    return start, until
