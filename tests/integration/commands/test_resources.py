"""Several publishers of resources at once: every version gets its own number in the
topic's order, and none loses what another published (resources.py's rule)."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import TopicPartition

from agl_stream.bus.streams import read_partitions
from agl_stream.commands import resources
from agl_stream.commands.resources import Change, ResourcesPublisher, read_resources
from agl_stream.events import PromptTemplate, ResourcesPublished
from agl_stream.runtime.config import KafkaSettings
from tests.support.backends import Backend

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


async def test_a_publisher_facing_a_frozen_broker_gives_up_with_a_reason_instead_of_hanging(
    kafka: KafkaSettings, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiokafka waits for a transaction coordinator without end: each round of a publish is
    bounded, so a broker that stops answering ends in ResourcesPublishError at the deadline
    (while it is still frozen), not in a trainer waiting for ever."""
    if not backend.can_pause:
        pytest.skip(f"the {backend.name} backend cannot freeze its broker")
    monkeypatch.setattr(resources, "ROUND_SECONDS", 1.0)
    monkeypatch.setattr(resources, "PUBLISH_SECONDS", 3.0)
    async with ResourcesPublisher(kafka, "test") as publisher:
        await publisher.publish(Change(resources={"prompt": PromptTemplate(template="a")}))
        thawed = asyncio.Event()

        async def freeze() -> None:
            await backend.pause_broker(20)
            thawed.set()

        frozen = asyncio.create_task(freeze())
        try:
            await asyncio.sleep(0.5)
            with pytest.raises(resources.ResourcesPublishError, match="within 3 s"):
                await publisher.publish(Change(resources={"prompt": PromptTemplate(template="b")}))
            assert not thawed.is_set()  # it gave up while the broker was still frozen
        finally:
            await frozen
        # The broker back: the same publisher publishes again.
        event = await publisher.publish(Change(resources={"prompt": PromptTemplate(template="c")}))
        assert event.resources["prompt"] == PromptTemplate(template="c")
