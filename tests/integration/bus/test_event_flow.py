"""Every event type through the real broker: published keyed to its topic, consumed by a
consumer group of two members that share the partitions, decoded, and committed."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import asyncpg
from aiokafka import TopicPartition

from agl_stream.bus.kafka import consumer, producer
from agl_stream.bus.streams import ConsumedEvent, EventPublisher, EventStream, Topics
from agl_stream.bus.topic_spec import load_topic_specs
from agl_stream.db.migrate import head_revision
from agl_stream.events import Event
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings
from tests.support.helpers import collect, eventually, examples, wait_for_assignment
from tests.support.strategies import EVENT_STRATEGIES

# The smallest session timeout brokers accept by default: a member that left without saying
# so is noticed soon.
FAST_GROUP = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 500}
EVENT_TOPICS = ["tasks", "rollouts", "spans", "resources", "workers"]


def sample_events(per_type: int) -> list[tuple[str, Event]]:
    home = {e: s.name for s in load_topic_specs().values() for e in s.events}
    return [
        (home[event_type], event)
        for event_type, strategy in sorted(EVENT_STRATEGIES.items())
        for event in examples(strategy, per_type)
    ]


async def test_two_members_share_partitions_and_see_every_event(kafka: KafkaSettings) -> None:
    topics = Topics(kafka)
    names = [topics.name(t) for t in EVENT_TOPICS]
    total_partitions = sum(topics.specs[t].partitions for t in EVENT_TOPICS)
    group = f"g-{uuid.uuid4().hex[:6]}"
    async with (
        producer(kafka) as prod,
        consumer(kafka, *names, group_id=group, **FAST_GROUP) as c1,
        consumer(kafka, *names, group_id=group, **FAST_GROUP) as c2,
    ):
        await wait_for_assignment([c1, c2], total_partitions)
        sent = sample_events(per_type=6)
        publisher = EventPublisher(prod, topics)
        for short, event in sent:
            await publisher.publish(short, event)

        streams = [EventStream(c, prod, topics, group) for c in (c1, c2)]
        seen: dict[int, list[ConsumedEvent]] = {0: [], 1: []}

        async def all_seen() -> bool:
            for i, stream in enumerate(streams):
                batch = await stream.next_batch(timeout_ms=100)
                seen[i] += list(batch)
                await stream.commit(batch)
                assert batch.dead_lettered == 0
            return len(seen[0]) + len(seen[1]) >= len(sent)

        await eventually(all_seen, 60, "every event")
        received = seen[0] + seen[1]
        assert Counter(e.event.event_id for e in received) == Counter(e.event_id for _, e in sent)
        assert seen[0] and seen[1], "both members consumed"
        by_id = {e.event_id: e for _, e in sent}
        for item in received:
            assert item.event == by_id[item.event.event_id]
        # A member only saw partitions it owned, and keys decide partitions: same key, same
        # partition, on every topic.
        placement: dict[tuple[str, str], set[int]] = {}
        for item in received:
            placement.setdefault((item.topic, item.event.key), set()).add(item.partition)
        assert all(len(p) == 1 for p in placement.values())
        # What a member consumed, it committed: up to the offset after its last record.
        last: dict[TopicPartition, int] = {}
        for item in seen[0]:
            tp = TopicPartition(item.topic, item.partition)
            last[tp] = max(last.get(tp, -1), item.offset)
        for tp, offset in last.items():
            assert await c1.committed(tp) == offset + 1


async def test_committed_offsets_resume_a_new_member(kafka: KafkaSettings) -> None:
    topics = Topics(kafka)
    group = f"g-{uuid.uuid4().hex[:6]}"
    strategy = EVENT_STRATEGIES["SpanRecorded"]
    first = examples(strategy, 20)
    second = examples(strategy, 15)
    async with producer(kafka) as prod:
        publisher = EventPublisher(prod, topics)
        await publisher.publish_many("spans", first)
        async with consumer(kafka, topics.name("spans"), group_id=group, **FAST_GROUP) as c:
            await collect(EventStream(c, prod, topics, group), len(first))
        await publisher.publish_many("spans", second)
        async with consumer(kafka, topics.name("spans"), group_id=group, **FAST_GROUP) as c:
            stream = EventStream(c, prod, topics, group)
            again = await collect(stream, len(second), commit=False)
            await asyncio.sleep(0.5)  # nothing from before the commit comes again
            again.extend(await stream.next_batch(timeout_ms=200))
    assert {e.event.event_id for e in again} == {e.event_id for e in second}


async def test_offsets_round_trip_through_the_database(database: DatabaseSettings) -> None:
    """The database the stack provides is migrated and takes consumer offsets atomically."""
    conn = await asyncpg.connect(database.asyncpg_dsn)
    try:
        async with conn.transaction():
            await conn.executemany(
                "INSERT INTO consumer_offsets (consumer, topic, partition, next_offset) "
                "VALUES ($1, $2, $3, $4) ON CONFLICT (consumer, topic, partition) "
                "DO UPDATE SET next_offset = EXCLUDED.next_offset",
                [("projector", "agl.spans", p, 10 * p) for p in range(4)],
            )
        rows = await conn.fetch("SELECT partition, next_offset FROM consumer_offsets ORDER BY 1")
        assert [(r["partition"], r["next_offset"]) for r in rows] == [(p, 10 * p) for p in range(4)]
        revision = await conn.fetchval("SELECT version_num FROM alembic_version")
        assert revision == head_revision()
    finally:
        await conn.close()


async def test_reading_a_partition_whose_records_retention_removed_returns(
    kafka: KafkaSettings,
) -> None:
    """Log start = end > 0 (every record deleted, as retention does): reading the partition
    from offset 0 ends at once instead of waiting for a record that never comes. Before, the
    read ended only on a record at end - 1, so it never returned (inside a rebalance callback,
    a runner group hung)."""
    from aiokafka.admin.records_to_delete import RecordsToDelete

    from agl_stream.bus.kafka import admin_client
    from agl_stream.bus.streams import read_partitions

    tp = TopicPartition(Topics(kafka).name("tasks"), 0)
    async with producer(kafka) as prod:
        for _ in range(5):
            await prod.send_and_wait(tp.topic, b"gone soon", partition=0)
    async with admin_client(kafka) as admin:
        await admin.delete_records({tp: RecordsToDelete(before_offset=5)})
    assert await asyncio.wait_for(read_partitions(kafka, [tp]), 30) == []
