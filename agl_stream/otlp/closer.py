"""Ending attempts nobody else will end once they have gone quiet: ingested ones
(`agl-stream ingest otlp --idle-timeout`) and sessions whose gateway was killed
(`agl-stream gateway`).

A consumer group reads the rollouts and spans topics (co-partitioned: the range assignor gives
a member partition p of both) into agl_stream.otlp.idle's fold, publishes what ends each
attempt quiet for the timeout once its partitions are read to their end, and commits the
fold's cut. Killed at any moment, the next member reads from the cut: it finds every open
attempt whole and every ended one as ended (its AttemptFinished is read back before anything
is due), so no attempt is left open or ended twice. Ingesters side by side share the work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import MutableMapping

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.errors import IllegalStateError

from agl_stream.bus.kafka import consumer, producer
from agl_stream.bus.streams import EventPublisher, EventStream, Topics
from agl_stream.otlp.idle import INGESTED, WATCHED_TOPICS, IdleAttempts, Watched
from agl_stream.runtime.config import KafkaSettings

log = logging.getLogger(__name__)
COMMIT_SECONDS = 5.0


async def end_idle_attempts(
    kafka: KafkaSettings,
    idle_seconds: float,
    group_id: str,
    stop: asyncio.Event,
    counts: MutableMapping[str, int],
    watched: Watched = INGESTED,
) -> None:
    """Until `stop`: end the `watched` attempts quiet for `idle_seconds` (counted in
    `counts["attempts_ended_idle"]`)."""
    topics = Topics(kafka)
    short = {topics.name(t): t for t in WATCHED_TOPICS}
    fold = IdleAttempts(idle_seconds, watched)
    async with (
        producer(kafka) as prod,
        consumer(
            kafka, group_id=group_id, partition_assignment_strategy=(RangePartitionAssignor,)
        ) as reader,
    ):
        publisher = EventPublisher(prod, topics)
        reader.subscribe(list(short), listener=_Forget(fold, short))
        # No dead letters from here: the projector sends those of these topics' records.
        stream = EventStream(reader, None, topics, group_id)
        committed = time.monotonic()
        while not stop.is_set():
            batch = await stream.next_batch(timeout_ms=500, max_records=5000)
            now_ms = int(time.time() * 1000)
            for item in batch:
                stamp = item.timestamp_ms if item.timestamp_ms is not None else now_ms
                fold.add((short[item.topic], item.partition), item.offset, item.event, stamp)
            positions = await _positions(reader, short)
            caught_up = [
                place
                for tp, place in _places(reader, short)
                if (end := reader.highwater(tp)) is not None and positions.get(place, -1) >= end
            ]
            for ending in fold.due(now_ms, caught_up):
                finished = ending.attempt
                await publisher.publish("rollouts", finished)
                if ending.rollout is not None:
                    await publisher.publish("rollouts", ending.rollout)
                counts["attempts_ended_idle"] = counts.get("attempts_ended_idle", 0) + 1
                log.info(
                    "attempt %s of rollout %s ended %s after %.0f s without a span (%d spans)",
                    finished.attempt_id, finished.rollout_id, finished.status.value,
                    ending.idle_seconds, finished.span_count,
                )  # fmt: skip
            counts["late_spans_dropped"] = fold.counts["late_spans_dropped"]
            if time.monotonic() - committed >= COMMIT_SECONDS or stop.is_set():
                await _commit(reader, fold, positions, topics)
                committed = time.monotonic()


def _places(
    reader: AIOKafkaConsumer, short: dict[str, str]
) -> list[tuple[TopicPartition, tuple[str, int]]]:
    return [(tp, (short[tp.topic], tp.partition)) for tp in reader.assignment()]


async def _positions(reader: AIOKafkaConsumer, short: dict[str, str]) -> dict[tuple[str, int], int]:
    positions = {}
    for tp, place in _places(reader, short):
        try:
            positions[place] = await reader.position(tp)
        except IllegalStateError:  # revoked meanwhile: the next round knows
            continue
    return positions


async def _commit(
    reader: AIOKafkaConsumer,
    fold: IdleAttempts,
    positions: dict[tuple[str, int], int],
    topics: Topics,
) -> None:
    cut = fold.cut(positions)
    offsets = {TopicPartition(topics.name(t), p): offset for (t, p), offset in cut.items()}
    assigned = reader.assignment()
    offsets = {tp: o for tp, o in offsets.items() if tp in assigned}
    if offsets:
        await reader.commit(offsets)


class _Forget(ConsumerRebalanceListener):  # type: ignore[misc]
    """Partitions that go take what was folded from them: their next reader starts from the
    committed cut, as a restarted one does."""

    def __init__(self, fold: IdleAttempts, short: dict[str, str]) -> None:
        self.fold = fold
        self.short = short

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        self.fold.forget((self.short[tp.topic], tp.partition) for tp in revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        return None
