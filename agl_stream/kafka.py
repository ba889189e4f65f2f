"""aiokafka clients built from settings, and offset lookups that hold on any Kafka broker."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from agl_stream.config import KafkaSettings

log = logging.getLogger(__name__)
T = TypeVar("T")


@asynccontextmanager
async def admin_client(settings: KafkaSettings) -> AsyncIterator[AIOKafkaAdminClient]:
    options = settings.client_options()
    options.pop("client_id")
    admin = AIOKafkaAdminClient(client_id=f"{settings.client_id}-admin", **options)
    try:
        await admin.start()
    except BaseException:
        await admin.close()
        raise
    try:
        yield admin
    finally:
        await admin.close()


async def started(client: AIOKafkaProducer | AIOKafkaConsumer) -> None:
    """Start a client; one that fails to start (no broker) is stopped, not left open."""
    try:
        await client.start()
    except BaseException:
        await client.stop()
        raise


@asynccontextmanager
async def producer(settings: KafkaSettings, **extra: Any) -> AsyncIterator[AIOKafkaProducer]:
    # Idempotent: a retried send after a lost acknowledgement is written once.
    client = AIOKafkaProducer(
        acks="all", enable_idempotence=True, **{**settings.client_options(), **extra}
    )
    await started(client)
    try:
        yield client
    finally:
        await client.stop()


@asynccontextmanager
async def consumer(
    settings: KafkaSettings, *topics: str, **extra: Any
) -> AsyncIterator[AIOKafkaConsumer]:
    # read_committed: runners write through transactions (agl_stream/runner/lane.py), and
    # what a fenced or failed runner left in an aborted one must never be read.
    defaults: dict[str, Any] = {
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "isolation_level": "read_committed",
    }
    client = AIOKafkaConsumer(*topics, **{**settings.client_options(), **defaults, **extra})
    await started(client)
    try:
        yield client
    finally:
        # aiokafka 0.14's stop() never returns when called in the same step as assign() or
        # seek(), before the fetcher has run once; one turn of the loop avoids it.
        await asyncio.sleep(0)
        await client.stop()


async def end_offsets(
    settings: KafkaSettings, partitions: Iterable[TopicPartition]
) -> dict[TopicPartition, int]:
    """The offset after the last record of each partition (ListOffsets, latest)."""
    wanted = list(partitions)
    if not wanted:
        return {}
    async with consumer(settings) as client:
        result: dict[TopicPartition, int] = await client.end_offsets(wanted)
        return result


async def retrying(attempt: Callable[[], Awaitable[T]], what: str, within: float = 60.0) -> T:
    """Run `attempt` again while it fails with a retriable Kafka error (a node of the
    cluster down for a moment, a coordinator or leader moving), with backoff, for up to
    `within` seconds; then, or on any other error, raise."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    delay = 0.2
    while True:
        try:
            return await attempt()
        except KafkaError as exc:
            if not exc.retriable or loop.time() + delay > deadline:
                raise
            log.warning("%s failed (%r); trying again in %.1f s", what, exc, delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)
