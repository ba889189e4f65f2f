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
    # acks=all and no idempotence: idempotent producers are not available on every
    # Kafka-protocol broker; consumers deduplicate instead (see DESIGN.md).
    client = AIOKafkaProducer(acks="all", **{**settings.client_options(), **extra})
    await started(client)
    try:
        yield client
    finally:
        await client.stop()


@asynccontextmanager
async def consumer(
    settings: KafkaSettings, *topics: str, **extra: Any
) -> AsyncIterator[AIOKafkaConsumer]:
    defaults: dict[str, Any] = {"enable_auto_commit": False, "auto_offset_reset": "earliest"}
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
    """The offset after the last record of each partition.

    Asks with ListOffsets, then confirms with the high watermark a fetch returns: some
    Kafka-protocol brokers answer ListOffsets from a stale cache, while the fetch's
    watermark is what consumers act on. On Apache Kafka both agree.
    """
    wanted = list(partitions)
    if not wanted:
        return {}
    async with consumer(settings, max_partition_fetch_bytes=1, fetch_max_wait_ms=50) as client:
        listed: dict[TopicPartition, int] = await client.end_offsets(wanted)
        client.assign(wanted)
        for tp in wanted:
            client.seek(tp, max(listed[tp] - 1, 0))
        result = dict(listed)
        pending = set(wanted)
        for _ in range(20):
            await client.getmany(*pending, timeout_ms=100)
            for tp in list(pending):
                watermark = client.highwater(tp)
                if watermark is not None:
                    result[tp] = max(result[tp], watermark)
                    pending.discard(tp)
            if not pending:
                break
            await asyncio.sleep(0)
        return result
