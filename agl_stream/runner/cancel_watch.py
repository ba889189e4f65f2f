"""The runner's cancel watch: cancels read ahead of the runner's claims.

A runner with every slot busy pauses its tasks partitions (it claims nothing it could not
run), so its own consumer reads no `RolloutCancelled` until a slot frees. The watch is a
second consumer, outside the group, assigned the tasks partitions the runner owns (those
with a lane) from their committed offsets on. It hands each cancel to the runner as soon as
it is read: a running attempt is stopped, and a rollout still waiting in the partition is
planned as cancelled when the runner reaches its record. Only cancels are decoded (the
event type header says which records are). The runner's own consumer still handles each
cancel when it gets there: applying a cancel twice changes nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from agl_stream.bus.codec import Codec, DecodeError
from agl_stream.bus.kafka import consumer
from agl_stream.bus.streams import EVENT_TYPE_HEADER
from agl_stream.events import RolloutCancelled
from agl_stream.runtime.config import KafkaSettings

CANCEL_TYPE = RolloutCancelled.type_name()
POLL_MS = 200

OnCancel = Callable[[TopicPartition, RolloutCancelled], None]


class Reader(Protocol):
    """What the watch needs of a consumer (an AIOKafkaConsumer with no group)."""

    def assign(self, partitions: list[TopicPartition]) -> None: ...

    def seek(self, partition: TopicPartition, offset: int) -> None: ...

    async def getmany(
        self, *partitions: TopicPartition, timeout_ms: int = 0
    ) -> dict[TopicPartition, list[ConsumerRecord]]: ...


def cancel_in(record: ConsumerRecord, codec: Codec) -> RolloutCancelled | None:
    """The record's cancel, or None when it is no cancel (queued rollouts are the bulk of
    the topic: told apart by their header, never decoded) or does not decode (the runner's
    own consumer dead-letters it)."""
    event_type = dict(record.headers or ()).get(EVENT_TYPE_HEADER)
    named = event_type.decode(errors="replace") if event_type is not None else None
    if (named or codec.event_type_of(record.value)) != CANCEL_TYPE:
        return None
    try:
        event = codec.decode(record.value)
    except DecodeError:
        return None
    return event if isinstance(event, RolloutCancelled) else None


class CancelWatch:
    """Which tasks partitions the watch reads and how far it has read each; `follow` reads
    them and hands every cancel to `on_cancel`. The runner changes the partitions (`add`,
    `drop`) as it gains and loses lanes; the watch picks the change up before its next read."""

    def __init__(self, on_cancel: OnCancel, codec: Codec | None = None) -> None:
        self.on_cancel = on_cancel
        self.codec = codec or Codec()
        # Partition -> the offset of the next record to read.
        self.positions: dict[TopicPartition, int] = {}
        self.version = 0  # bumped by every change of the partitions
        self.changed = asyncio.Event()

    def add(self, tp: TopicPartition, offset: int) -> None:
        """Read `tp` from `offset` on (again from there, if it was being read)."""
        self.positions[tp] = offset
        self._bump()

    def drop(self, tps: Iterable[TopicPartition]) -> None:
        dropped = [tp for tp in tps if self.positions.pop(tp, None) is not None]
        if dropped:
            self._bump()

    def take(self, records: Mapping[TopicPartition, Sequence[ConsumerRecord]]) -> int:
        """Hand the cancels among `records` (read under the current partitions) to the
        runner and move past them; returns how many cancels there were."""
        cancels = 0
        for tp, items in records.items():
            if tp not in self.positions or not items:
                continue
            for record in items:
                event = cancel_in(record, self.codec)
                if event is not None:
                    self.on_cancel(tp, event)
                    cancels += 1
            self.positions[tp] = max(self.positions[tp], items[-1].offset + 1)
        return cancels

    async def follow(self, kafka: KafkaSettings) -> None:
        """Read the partitions until cancelled (read_committed, like every consumer here)."""
        async with consumer(kafka) as reader:
            await self.follow_with(reader)

    async def follow_with(self, reader: Reader, poll_ms: int = POLL_MS) -> None:
        # Started again after a failure, it goes on from the positions kept here.
        seen = -1
        while True:
            if seen != self.version:
                seen = self.version
                self.changed.clear()
                # assign() replaces the whole assignment and forgets every position.
                reader.assign(list(self.positions))
                for tp, offset in self.positions.items():
                    reader.seek(tp, offset)
            if not self.positions:
                await self.changed.wait()
                continue
            records = await reader.getmany(timeout_ms=poll_ms)
            if seen == self.version:
                self.take(records)
            # else: the partitions changed while it read; the next read starts again from
            # the positions kept, so nothing is lost and nothing goes to a lost partition.

    def _bump(self) -> None:
        self.version += 1
        self.changed.set()


__all__ = ["CancelWatch", "Reader", "cancel_in"]
