"""The resources a runner hands its agents: the latest version, and any pinned one."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaProducer, TopicPartition

from agl_stream.config import KafkaSettings
from agl_stream.events import ResourcesPublished
from agl_stream.kafka import consumer
from agl_stream.streams import EventStream, Topics, read_partitions


@dataclass
class ResourceCache:
    """A fold over the compacted resources topic (every version is kept by its id)."""

    versions: dict[str, ResourcesPublished] = field(default_factory=dict)
    latest: ResourcesPublished | None = None
    _changed: asyncio.Event | None = None

    def apply(self, event: ResourcesPublished) -> None:
        self.versions[event.resources_id] = event
        # A pin-only version (a candidate under evaluation) runs only in tasks that pin it.
        if not event.pin_only and (self.latest is None or event.version >= self.latest.version):
            self.latest = event
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def wait_for(self, resources_id: str, within: float) -> ResourcesPublished | None:
        """A pinned version the runner has not seen yet: it may be on its way (published
        just before the task that pins it was enqueued). None if it does not come."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while resources_id not in self.versions:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            try:
                await asyncio.wait_for(self.changed(), remaining)
            except TimeoutError:
                return None
        return self.versions[resources_id]

    async def changed(self) -> None:
        """Return when the next version is applied."""
        if self._changed is None:
            self._changed = asyncio.Event()
        await self._changed.wait()

    @property
    def top_version(self) -> int:
        """The highest version number published, pin-only ones included (-1: none)."""
        return max((e.version for e in self.versions.values()), default=-1)

    def resolve(self, pinned: str | None) -> ResourcesPublished | None:
        """The pinned version, or the latest; raises KeyError for an unknown pin."""
        if pinned is None:
            return self.latest
        return self.versions[pinned]


def resource_partitions(kafka: KafkaSettings) -> list[TopicPartition]:
    topics = Topics(kafka)
    topic = topics.name("resources")
    return [TopicPartition(topic, p) for p in range(topics.specs["resources"].partitions)]


async def read_resources(kafka: KafkaSettings) -> ResourceCache:
    """Every version on the compacted resources topic now (undecodable records skipped)."""
    cache = ResourceCache()
    for event in await read_partitions(kafka, resource_partitions(kafka)):
        if isinstance(event, ResourcesPublished):
            cache.apply(event)
    return cache


async def follow_resources(
    kafka: KafkaSettings,
    producer: AIOKafkaProducer,
    cache: ResourceCache,
    name: str,
    loaded: Callable[[], None] = lambda: None,
) -> None:
    """Fold the compacted resources topic into `cache` from its start (then call `loaded`),
    and go on folding what is published. Undecodable records go to the dead-letter topic."""
    topics = Topics(kafka)
    tps = resource_partitions(kafka)
    ends: dict[TopicPartition, int] = {}
    for event in await read_partitions(kafka, tps, ends):
        if isinstance(event, ResourcesPublished):
            cache.apply(event)
    loaded()
    async with consumer(kafka) as follower:
        follower.assign(tps)
        for tp in tps:
            follower.seek(tp, ends.get(tp, 0))
        stream = EventStream(follower, producer, topics, f"{name}/resources")
        while True:
            for item in await stream.next_batch(timeout_ms=1000):
                if isinstance(item.event, ResourcesPublished):
                    cache.apply(item.event)
