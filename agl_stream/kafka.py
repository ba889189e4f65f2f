"""aiokafka clients built from settings, and offset lookups that hold on any Kafka broker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from agl_stream.config import KafkaSettings


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
