"""The Confluent framing on the real broker with a real registry (Apicurio, built from Maven
Central): topics holding both framings are read whole on the runner's and the projector's
read path, an unknown schema id is dead-lettered with the reason, and a producer switches
framing while a consumer keeps reading."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Mapping

import pytest

from agl_stream.bus import codec as codec_module
from agl_stream.bus.codec import Codec, Wire
from agl_stream.bus.kafka import consumer, producer
from agl_stream.bus.registry_client import COMPATIBILITY
from agl_stream.bus.streams import Batch, Converter, EventPublisher, EventStream, Topics
from agl_stream.bus.wire import Framing, confluent_header, split
from agl_stream.events import Event
from agl_stream.projection.apply import CONVERTERS
from agl_stream.queries.dead_letters import read_dead_letters
from agl_stream.runtime.config import KafkaSettings
from tests.integration.bus.test_dead_letters import _event_ids
from tests.support.helpers import eventually, examples
from tests.support.strategies import EVENT_STRATEGIES

# The runner reads tasks, the projector reads everything (spans through its row converter).
TOPIC_EVENTS = {"tasks": "RolloutQueued", "spans": "SpanRecorded", "rollouts": "AttemptFinished"}


def codecs(kafka: KafkaSettings, registry_url: str) -> tuple[Codec, Codec]:
    """A single-object writer and a confluent writer, sharing nothing but the registry."""
    single = Codec(wire=Wire(Framing.SINGLE_OBJECT, codec_module.schema_ids(registry_url, kafka)))
    confluent = Codec(wire=Wire(Framing.CONFLUENT, codec_module.schema_ids(registry_url, kafka)))
    return single, confluent


def fresh_reader(kafka: KafkaSettings, registry_url: str) -> Codec:
    """A consumer's codec that has seen no id yet: it learns them from the registry."""
    return Codec(wire=Wire(Framing.SINGLE_OBJECT, codec_module.schema_ids(registry_url, kafka)))


@pytest.mark.parametrize("converters", [None, CONVERTERS], ids=["runner", "projector"])
async def test_a_topic_holding_both_framings_is_read_whole(
    kafka: KafkaSettings, schema_registry: str, converters: Mapping[str, Converter] | None
) -> None:
    topics = Topics(kafka)
    single, confluent = codecs(kafka, schema_registry)
    sent: set[str] = set()
    framings: set[Framing] = set()
    async with producer(kafka) as prod:
        writers = [EventPublisher(prod, topics, single), EventPublisher(prod, topics, confluent)]
        for short, event_type in TOPIC_EVENTS.items():
            for i, event in enumerate(examples(EVENT_STRATEGIES[event_type], 10)):
                writer = writers[i % 2]
                framings.add(split(writer.prepare(short, event).value).framing)
                await writer.publish(short, event)
                sent.add(str(event.event_id))
        assert framings == {Framing.SINGLE_OBJECT, Framing.CONFLUENT}

        group = f"g-{uuid.uuid4().hex[:6]}"
        names = [topics.name(t) for t in TOPIC_EVENTS]
        async with consumer(kafka, *names, group_id=group) as c:
            stream = EventStream(
                c, prod, topics, group, fresh_reader(kafka, schema_registry), converters
            )
            delivered: list[str] = []
            dead = 0

            async def everything() -> bool:
                nonlocal dead
                batch = await stream.next_batch(timeout_ms=100)
                delivered.extend(_event_ids(batch))
                dead += batch.dead_lettered
                return len(delivered) + dead >= len(sent)

            await eventually(everything, 60, "every record of both framings")
    assert dead == 0
    assert sorted(delivered) == sorted(sent)


async def test_an_unknown_schema_id_is_dead_lettered_with_the_reason(
    kafka: KafkaSettings, schema_registry: str
) -> None:
    topics = Topics(kafka)
    _, confluent = codecs(kafka, schema_registry)
    good = examples(EVENT_STRATEGIES["RolloutQueued"], 2)
    unknown_id = 2_000_000_000
    body = confluent.encode(good[0])[5:]
    async with producer(kafka) as prod:
        meta = await prod.send_and_wait(
            topics.name("tasks"), confluent_header(unknown_id) + body, key=b"k"
        )
        await EventPublisher(prod, topics, confluent).publish("tasks", good[1])

        group = f"g-{uuid.uuid4().hex[:6]}"
        async with consumer(kafka, topics.name("tasks"), group_id=group) as c:
            stream = EventStream(c, prod, topics, group, fresh_reader(kafka, schema_registry))
            delivered: list[Event] = []
            dead = 0

            async def both() -> bool:
                nonlocal dead
                batch: Batch = await stream.next_batch(timeout_ms=100)
                delivered.extend(item.event for item in batch)
                dead += batch.dead_lettered
                return len(delivered) + dead >= 2

            await eventually(both, 30, "the bad record and the good one")
    assert [e.event_id for e in delivered] == [good[1].event_id]
    letters = await read_dead_letters(kafka, limit=10)
    assert [(x.source_topic, x.source_offset) for x in letters] == [(meta.topic, meta.offset)]
    assert letters[0].kind == "unknown_schema"
    assert f"unknown schema id {unknown_id}" in letters[0].reason
    assert "does not know it" in letters[0].reason


async def test_a_producer_switches_to_confluent_while_a_consumer_reads(
    kafka: KafkaSettings, schema_registry: str
) -> None:
    """No downtime: the consumer started on single-object records keeps going when the
    producer moves to the Confluent framing mid-stream, and misses nothing."""
    topics = Topics(kafka)
    single, confluent = codecs(kafka, schema_registry)
    events = examples(EVENT_STRATEGIES["SpanRecorded"], 40)
    group = f"g-{uuid.uuid4().hex[:6]}"
    delivered: list[str] = []
    dead = 0
    async with producer(kafka) as prod, consumer(kafka, topics.name("spans"), group_id=group) as c:
        stream = EventStream(c, prod, topics, group, fresh_reader(kafka, schema_registry))
        stop = asyncio.Event()

        async def consume() -> None:
            nonlocal dead
            while not stop.is_set():
                batch = await stream.next_batch(timeout_ms=50)
                delivered.extend(_event_ids(batch))
                dead += batch.dead_lettered
                await stream.commit(batch)

        reader = asyncio.create_task(consume())
        try:
            publisher = EventPublisher(prod, topics, single)
            for i, event in enumerate(events):
                if i == len(events) // 2:
                    await eventually(
                        _at_least(delivered, len(events) // 2), 30, "the single-object half"
                    )
                    publisher = EventPublisher(prod, topics, confluent)  # the switch
                await publisher.publish("spans", event)
            await eventually(_at_least(delivered, len(events)), 30, "the confluent half")
        finally:
            stop.set()
            await reader
    assert dead == 0
    assert sorted(delivered) == sorted(str(e.event_id) for e in events)


async def test_registered_subjects_hold_the_compatibility_schemas_check_enforces(
    kafka: KafkaSettings, schema_registry: str
) -> None:
    ids = codec_module.schema_ids(schema_registry, kafka)
    done = await asyncio.to_thread(ids.register_all)
    subjects = {name for name, _, _ in done}
    assert f"{kafka.topic_prefix}tasks-ai.aglstream.RolloutQueued" in subjects
    for name in subjects:
        assert await asyncio.to_thread(ids.client.compatibility, name) == COMPATIBILITY


def _at_least(items: list[str], count: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return len(items) >= count

    return check
