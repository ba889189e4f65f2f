"""Several publishers of resources at once: every version gets its own number in the
topic's order, and none loses what another published (resources.py's rule)."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import TopicPartition

from agl_stream.config import KafkaSettings
from agl_stream.events import PromptTemplate, ResourcesPublished
from agl_stream.resources import Change, ResourcesPublisher, read_resources
from agl_stream.streams import read_partitions

pytestmark = pytest.mark.slow


async def test_concurrent_publishers_never_collide_or_lose_an_update(
    kafka: KafkaSettings,
) -> None:
    names = ("trainer", "apo", "person")
    rounds = 6

    async def publish(name: str) -> None:
        async with ResourcesPublisher(kafka, name) as publisher:
            for i in range(rounds):
                change = Change(
                    resources={name: PromptTemplate(template=f"{name} {i}")},
                    resources_id=f"{name}-{i}",
                )
                await publisher.publish(change)

    await asyncio.gather(*(publish(name) for name in names))
    events = await read_partitions(kafka, [TopicPartition(kafka.topic("resources"), 0)])
    versions = [e for e in events if isinstance(e, ResourcesPublished)]
    assert [v.version for v in versions] == list(range(len(names) * rounds))  # topic order
    # Each version holds every publisher's latest value as of its place in the topic.
    seen: dict[str, object] = {}
    for v in versions:
        (own,) = [n for n in names if v.resources_id.startswith(f"{n}-")]
        seen[own] = v.resources[own]
        assert v.resources == seen, v.resources_id
    latest = (await read_resources(kafka)).latest
    assert latest is not None
    assert latest.resources == {n: PromptTemplate(template=f"{n} {rounds - 1}") for n in names}
