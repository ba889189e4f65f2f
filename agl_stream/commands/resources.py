"""Versioned resources: following the resources topic, which version is latest, publishing.

One rule for every publisher (the GRPO trainer, APO, `agl-stream resources publish`, the
demo, a person's script):

- Publishing is serialised. A publisher takes the resources topic's publishing lane (a
  transactional producer whose id all of a deployment's publishers share, so taking it
  fences whoever held it), reads the topic to its end, and publishes the next version in a
  transaction: numbered one above the highest, holding the latest version's resources with
  its own on top (unless it asks not to carry them). A publisher fenced meanwhile starts
  again from what the other one published. So numbers never collide, they grow in the
  topic's order, and no publisher loses another's update.
- The latest version is the highest-numbered one that is not pin-only (a candidate under
  evaluation runs only in tasks that pin it).
- A version is immutable: publishing an id again with the same resources returns the
  version already there; with other resources it is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from agl_stream.bus.codec import Codec, DecodeError
from agl_stream.bus.kafka import consumer, reachable, started
from agl_stream.bus.streams import EVENT_TYPE_HEADER, EventStream, Topics, read_partition_from
from agl_stream.events import ResourcesPublished
from agl_stream.events.resources import PIN_ONLY, Resource
from agl_stream.runtime.config import KafkaSettings

log = logging.getLogger(__name__)
T = TypeVar("T")

PUBLISH_SECONDS = 60.0
# One broker round of a publish (the producer's start, a send, the commit). aiokafka waits
# for a transaction coordinator without end; past this the try counts as failed.
ROUND_SECONDS = 15.0


class ResourcesConflict(ValueError):
    """A resources id that is already published with other resources."""


class ResourcesPublishError(RuntimeError):
    """A version that could not be published (the broker kept refusing)."""


class _Stuck(KafkaError):  # type: ignore[misc]
    """A round of a publish that did not finish in time (tried again like a broker error)."""


async def _within(awaitable: Awaitable[T], what: str) -> T:
    """`awaitable`'s result, or _Stuck after ROUND_SECONDS. A coroutine is stopped then; a
    future of aiokafka's is left to it (its producer is dropped, which fails it)."""
    waited = asyncio.ensure_future(awaitable)
    ours = waited is not awaitable
    try:
        done, _ = await asyncio.wait({waited}, timeout=ROUND_SECONDS)
    except asyncio.CancelledError:
        if ours:
            waited.cancel()
        raise
    if not done:
        if ours:
            waited.cancel()
        # Whatever it ends with later is retrieved here, not reported as never retrieved.
        waited.add_done_callback(lambda f: f.cancelled() or f.exception())
        raise _Stuck(f"{what} did not finish within {ROUND_SECONDS:.0f} s")
    return waited.result()


@dataclass
class ResourceCache:
    """A fold over the compacted resources topic (every version is kept by its id)."""

    versions: dict[str, ResourcesPublished] = field(default_factory=dict)
    latest: ResourcesPublished | None = None
    _changed: asyncio.Event | None = None

    def apply(self, event: ResourcesPublished) -> None:
        self.versions[event.resources_id] = event
        if not event.pin_only and (self.latest is None or event.version >= self.latest.version):
            self.latest = event
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def wait_for(self, resources_id: str, within: float) -> ResourcesPublished | None:
        """A pinned version not seen yet: it may be on its way (published just before the
        task that pins it was enqueued). None if it does not come."""
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

    def next_change(self) -> asyncio.Event:
        """Set when the next version is applied (taken now, so no change in between is
        missed by a waiter that starts later)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    async def changed(self) -> None:
        """Return when the next version is applied."""
        await self.next_change().wait()

    @property
    def top_version(self) -> int:
        """The highest version number published, pin-only ones included (-1: none)."""
        return max((e.version for e in self.versions.values()), default=-1)

    def resolve(self, pinned: str | None) -> ResourcesPublished | None:
        """The pinned version, or the latest; raises KeyError for an unknown pin."""
        if pinned is None:
            return self.latest
        return self.versions[pinned]


def resources_partition(kafka: KafkaSettings) -> TopicPartition:
    """The resources topic's one partition: its order is the order of publication."""
    topics = Topics(kafka)
    partitions = topics.specs["resources"].partitions
    if partitions != 1:
        raise ValueError(
            f"the resources topic must have exactly 1 partition (its order is the order of "
            f"publication), its spec says {partitions}"
        )
    return TopicPartition(topics.name("resources"), 0)


async def read_resources(kafka: KafkaSettings) -> ResourceCache:
    """Every version on the resources topic now (undecodable records skipped)."""
    cache = ResourceCache()
    await _fold(kafka, cache, 0)
    return cache


async def _fold(kafka: KafkaSettings, cache: ResourceCache, start: int) -> int:
    """Fold the versions from `start` to the end now into `cache`; returns that end."""
    events, end = await read_partition_from(kafka, resources_partition(kafka), start)
    for _, event in events:
        if isinstance(event, ResourcesPublished):
            cache.apply(event)
    return end


async def follow_resources(
    kafka: KafkaSettings,
    producer: AIOKafkaProducer,
    cache: ResourceCache,
    name: str,
    loaded: Callable[[], None] = lambda: None,
) -> None:
    """Fold the resources topic into `cache` from its start (then call `loaded`), and go on
    folding what is published. Undecodable records go to the dead-letter topic."""
    tp = resources_partition(kafka)
    end = await _fold(kafka, cache, 0)
    loaded()
    async with consumer(kafka) as follower:
        follower.assign([tp])
        follower.seek(tp, end)
        stream = EventStream(follower, producer, Topics(kafka), f"{name}/resources")
        while True:
            for item in await stream.next_batch(timeout_ms=1000):
                if isinstance(item.event, ResourcesPublished):
                    cache.apply(item.event)


@dataclass(frozen=True)
class Change:
    """A new version as its publisher sees it: what it sets. `resources_id` None names it
    `<id_prefix>-v<number>`; `carry` holds the latest version's other resources too."""

    resources: Mapping[str, Resource]
    resources_id: str | None = None
    id_prefix: str = "resources"
    carry: bool = True
    pin_only: bool = False
    parent_resources_id: str | None = None  # default: the latest version
    metadata: Mapping[str, str] = field(default_factory=dict)
    # For a change without an id: how to recognise it on the topic if it is out already (a
    # publisher stopped, or a commit that succeeded but was not acknowledged), looked for
    # under the fence after reading to the end, so it is published once.
    same_as: Callable[[ResourcesPublished], bool] | None = None


def next_version(cache: ResourceCache, change: Change, published_by: str) -> ResourcesPublished:
    """The version `change` makes on top of what `cache` holds (read to the topic's end)."""
    number = cache.top_version + 1
    resources_id = change.resources_id or f"{change.id_prefix}-v{number}"
    if resources_id in cache.versions:  # a generated id someone took by hand
        resources_id = f"{resources_id}-{secrets.token_hex(3)}"
    latest = cache.latest
    carried = dict(latest.resources) if change.carry and latest is not None else {}
    metadata = {**change.metadata, **({PIN_ONLY: "true"} if change.pin_only else {})}
    parent = change.parent_resources_id or (latest.resources_id if latest else None)
    return ResourcesPublished(
        resources_id=resources_id,
        version=number, resources={**carried, **change.resources}, published_by=published_by,
        parent_resources_id=parent, metadata=metadata,
    )  # fmt: skip


def already_published(cache: ResourceCache, change: Change) -> ResourcesPublished | None:
    """The version a repeated publication of `change` finds (same id, same resources);
    raises ResourcesConflict when the id holds other resources."""
    if change.resources_id is None:
        found = [v for v in cache.versions.values() if change.same_as and change.same_as(v)]
        return found[0] if found else None
    existing = cache.versions.get(change.resources_id)
    if existing is None:
        return None
    differs = any(existing.resources.get(k) != v for k, v in change.resources.items())
    if differs or existing.pin_only != change.pin_only:
        raise ResourcesConflict(
            f"{change.resources_id} is already published with other resources; versions are "
            "immutable, publish under a new id"
        )
    return existing


class ResourcesPublisher:
    """Publishes versions by the rule above. Keep one per process and reuse it: it reads
    only what is new (it takes the publishing lane for each publish and lets it go after)."""

    def __init__(self, kafka: KafkaSettings, published_by: str) -> None:
        self.kafka = kafka
        self.published_by = published_by
        self.topics = Topics(kafka)
        self.tp = resources_partition(kafka)
        self.cache = ResourceCache()
        self._read_until = 0
        self._producer: AIOKafkaProducer | None = None
        # Kept between publishes: a consumer per publish cost a connection and a 200 ms
        # wait on the trailing commit marker every time (a step of the demo waited on it).
        self._reader: AIOKafkaConsumer | None = None
        self._reader_stack = contextlib.AsyncExitStack()
        self._codec = Codec()
        self.created: set[str] = set()  # ids this publisher published (not found published)

    async def publish(self, change: Change) -> ResourcesPublished:
        """Publish `change` as the next version (or find it published already)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PUBLISH_SECONDS
        delay = 0.05
        while True:
            try:
                published = await self._publish_once(change)
                # The lane is let go of: another publisher (a second policy's trainer, a
                # driver) takes it next, and a producer kept would be fenced with nobody
                # awaiting its sender (an exception never retrieved, logged at each take).
                await self._drop_producer()
                return published
            except KafkaError as exc:  # fenced by another publisher, or the broker failed
                await self._drop_producer()
                await self._drop_reader()
                if loop.time() > deadline:
                    raise ResourcesPublishError(
                        f"could not publish a resources version within {PUBLISH_SECONDS:.0f} "
                        f"s: {exc!r}"
                    ) from exc
                log.info("publishing resources again after %r", exc)
                # Jittered, so that publishers that fenced each other do not meet again.
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 2.0)

    async def close(self) -> None:
        await self._drop_producer()
        await self._drop_reader()

    async def __aenter__(self) -> ResourcesPublisher:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def _publish_once(self, change: Change) -> ResourcesPublished:
        if self._producer is None:
            self._producer = AIOKafkaProducer(
                acks="all", enable_idempotence=True,
                transactional_id=f"{self.tp.topic}.publisher",
                **(await reachable(self.kafka)).client_options(),
            )  # fmt: skip
            # Its start fences the lane's previous holder.
            await _within(started(self._producer), "starting the publishing producer")
        await _within(self._catch_up(), "reading the resources topic")
        existing = already_published(self.cache, change)
        if existing is not None:
            return existing
        event = next_version(self.cache, change, self.published_by)
        value = self._codec.encode(event)
        await self._producer.begin_transaction()
        try:
            sent = await _within(
                self._producer.send(
                    self.tp.topic, value, key=event.key.encode(), partition=0,
                    headers=[(EVENT_TYPE_HEADER, event.type_name().encode())],
                ),
                "queueing the version",
            )  # fmt: skip
            meta = await _within(sent, "sending the version")
            await _within(self._producer.commit_transaction(), "committing the version")
        except BaseException:
            # Whatever became of the transaction, the next try starts from a new producer
            # (whose start aborts it, or finds it committed when it reads to the end).
            await self._drop_producer()
            raise
        self.cache.apply(event)
        self._read_until = max(self._read_until, meta.offset + 1)
        self.created.add(event.resources_id)
        return event

    async def _catch_up(self) -> None:
        """Fold what was published since the last look, up to the partition's end now."""
        if self._reader is None:
            opened: AIOKafkaConsumer = await self._reader_stack.enter_async_context(
                consumer(self.kafka)
            )
            opened.assign([self.tp])
            opened.seek(self.tp, self._read_until)
            self._reader = opened
        reader: AIOKafkaConsumer = self._reader
        end = (await reader.end_offsets([self.tp]))[self.tp]
        # Short polls: the last offsets may be a commit marker, which no poll returns (only
        # the position moves past it).
        while await reader.position(self.tp) < end:
            batch = await reader.getmany(self.tp, timeout_ms=10)
            for record in batch.get(self.tp, []):
                with contextlib.suppress(DecodeError):
                    event = self._codec.decode(record.value)
                    if isinstance(event, ResourcesPublished):
                        self.cache.apply(event)
        self._read_until = await reader.position(self.tp)

    async def _drop_reader(self) -> None:
        self._reader = None
        try:
            await asyncio.wait_for(self._reader_stack.aclose(), ROUND_SECONDS)
        except Exception as exc:  # noqa: BLE001 - a consumer of a failed broker may fail to stop
            log.debug("stopping the resources publisher's reader: %r", exc)
        self._reader_stack = contextlib.AsyncExitStack()

    async def _drop_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                await asyncio.wait_for(producer.stop(), ROUND_SECONDS)
            except Exception as exc:  # noqa: BLE001 - a fenced producer may fail to stop; it is gone either way
                log.debug("stopping the resources publisher: %r", exc)


async def publish_resources(
    kafka: KafkaSettings, change: Change, published_by: str
) -> ResourcesPublished:
    """Publish one version (a one-off publisher: the CLI, a script)."""
    async with ResourcesPublisher(kafka, published_by) as publisher:
        return await publisher.publish(change)


__all__ = [
    "Change",
    "ResourceCache",
    "ResourcesConflict",
    "ResourcesPublishError",
    "ResourcesPublisher",
    "follow_resources",
    "publish_resources",
    "read_resources",
    "resources_partition",
]
