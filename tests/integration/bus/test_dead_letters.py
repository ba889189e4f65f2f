"""Bad records on every topic land in the dead-letter topic with a reason and their origin,
and the consumer reading them stays alive and keeps delivering good events."""

from __future__ import annotations

import uuid
from collections.abc import Mapping

import pytest

from agl_stream.bus.codec import Codec
from agl_stream.bus.dead_letters import DeadLetterView
from agl_stream.bus.kafka import consumer, producer
from agl_stream.bus.streams import Batch, Converter, EventPublisher, EventStream, Topics
from agl_stream.projection.apply import CONVERTERS
from agl_stream.projection.copy_binary import COLUMNS as COPY_COLUMNS
from agl_stream.projection.rows import SpanRow
from agl_stream.queries.dead_letters import read_dead_letters
from agl_stream.runtime.config import KafkaSettings
from tests.support.bad_records import EVENT_TOPICS, EXPECTED_KIND, bad_records
from tests.support.helpers import eventually, examples
from tests.support.strategies import EVENT_STRATEGIES


@pytest.mark.parametrize("converters", [None, CONVERTERS], ids=["events", "projector rows"])
async def test_bad_records_on_every_topic_are_dead_lettered(
    kafka: KafkaSettings, converters: Mapping[str, Converter] | None
) -> None:
    """The same with the projector's converters (spans straight to rows): the same records
    are refused, for the same reasons."""
    topics = Topics(kafka)
    codec = Codec()
    group = f"g-{uuid.uuid4().hex[:6]}"
    names = [topics.name(t) for t in EVENT_TOPICS]
    sent_bad: dict[tuple[str, int, int], str] = {}
    good_ids = set()
    async with producer(kafka) as prod:
        publisher = EventPublisher(prod, topics)
        for short in EVENT_TOPICS:
            for label, value in bad_records(codec, short).items():
                meta = await prod.send_and_wait(
                    topics.name(short),
                    value,
                    key=b"k-" + label.encode(),
                    headers=[("origin", b"test")],
                )
                sent_bad[(meta.topic, meta.partition, meta.offset)] = label
            # a good event after the bad ones: the consumer must still deliver it
            event = examples(EVENT_STRATEGIES[EVENT_TOPICS[short]], 1)[0]
            await publisher.publish(short, event)
            good_ids.add(str(event.event_id))

        async with consumer(
            kafka, *names, group_id=group, session_timeout_ms=6000, heartbeat_interval_ms=500
        ) as c:
            stream = EventStream(c, prod, topics, consumer_name=group, converters=converters)
            delivered: list[str] = []
            dead = 0

            async def through() -> bool:
                nonlocal dead
                batch = await stream.next_batch(timeout_ms=100)
                delivered.extend(_event_ids(batch))
                dead += batch.dead_lettered
                await stream.commit(batch)
                return len(delivered) + dead >= len(sent_bad) + len(good_ids)

            await eventually(through, 60, "every record")
            assert set(delivered) == good_ids
            assert dead == len(sent_bad)

            # The consumer is alive: a later good event still arrives.
            late = examples(EVENT_STRATEGIES["SpanRecorded"], 1)[0]
            await publisher.publish("spans", late)
            later: list[str] = []

            async def arrived() -> bool:
                later.extend(_event_ids(await stream.next_batch(timeout_ms=100)))
                return str(late.event_id) in later

            await eventually(arrived, 30, "a good event after the bad ones")

    letters = await read_dead_letters(kafka, limit=100)
    by_source = {(x.source_topic, x.source_partition, x.source_offset): x for x in letters}
    assert set(by_source) == set(sent_bad)
    for source, label in sent_bad.items():
        letter: DeadLetterView = by_source[source]
        assert letter.kind == EXPECTED_KIND[label], (label, letter.reason)
        assert letter.reason
        if label == "invalid":
            assert "trace_id" in letter.reason
        assert letter.consumer == group
    first = letters[0]
    assert first.value is not None


def _event_ids(batch: Batch) -> list[str]:
    """Event ids of what a batch delivered, as events or as converted span rows."""
    ids = [str(item.event.event_id) for item in batch]
    ids += [_span_event_id(c.value) for items in batch.converted.values() for c in items]
    return ids


def _span_event_id(value: SpanRow | bytes) -> str:
    if isinstance(value, bytes):  # a binary COPY tuple: field count, length, then the uuid
        assert COPY_COLUMNS[0] == "event_id"
        return str(uuid.UUID(bytes=value[6:22]))
    return str(value.event_id)
