"""Which offsets an offline retrain reads: per partition of the trained topics, from a start
(an offset, a time, or the beginning) to an end (an offset, a time, or the end now)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from aiokafka import TopicPartition

from agl_stream.config import KafkaSettings
from agl_stream.kafka import consumer, end_offsets
from agl_stream.streams import Topics
from agl_stream.training.trajectories import TopicPartition as TP

TRAINED_TOPICS = ("tasks", "rollouts", "spans")


async def resolve_range(
    kafka: KafkaSettings,
    starts: Mapping[TP, int],
    ends: Mapping[TP, int],
    from_time: datetime | None,
    until_time: datetime | None,
) -> tuple[dict[TP, int], dict[TP, int]]:
    topics = Topics(kafka)
    tps = [(t, p) for t in TRAINED_TOPICS for p in range(topics.specs[t].partitions)]
    full = {tp: TopicPartition(topics.name(tp[0]), tp[1]) for tp in tps}
    last = await end_offsets(kafka, full.values())
    async with consumer(kafka) as client:
        first = await client.beginning_offsets(list(full.values()))
        at_from = await _at(client, full, from_time, last) if from_time else {}
        at_until = await _at(client, full, until_time, last) if until_time else {}
    start = {tp: starts.get(tp, at_from.get(tp, first[full[tp]])) for tp in tps}
    until = {tp: min(ends.get(tp, last[full[tp]]), at_until.get(tp, last[full[tp]])) for tp in tps}
    for tp in tps:
        if until[tp] < start[tp]:
            raise ValueError(
                f"{tp[0]}:{tp[1]}: the range ends at {until[tp]}, before it starts at {start[tp]}"
            )
    return start, until


async def _at(
    client: object,
    full: Mapping[TP, TopicPartition],
    when: datetime,
    last: Mapping[TopicPartition, int],
) -> dict[TP, int]:
    """The first offset written at or after `when` (the end where there is none)."""
    millis = int(when.timestamp() * 1000)
    found = await client.offsets_for_times(dict.fromkeys(full.values(), millis))  # type: ignore[attr-defined]
    return {
        tp: (found[t].offset if found.get(t) is not None else last[t]) for tp, t in full.items()
    }
