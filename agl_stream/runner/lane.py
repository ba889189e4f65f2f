"""The one writer of a tasks partition's effects: a transactional producer per partition.

Its transactional id is the partition's (`<group>.tasks-<p>`), so when the group gives the
partition to another runner, that runner's lane fences this one: Kafka aborts the open
transaction and refuses every later one. A runner frozen past its session timeout and then
resumed can therefore never publish a second successful attempt of a rollout another runner
took over. Events go out in transactions of at most `interval` seconds each, together with
the partition's tasks offset (and where the next owner should start folding the rollouts
partition), so consumers reading committed data see an attempt's effects and the offset
that covers them at once or not at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, field

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import OffsetAndMetadata, RecordMetadata

from agl_stream.bus.codec import Codec
from agl_stream.bus.kafka import MAX_RECORD_BYTES, started
from agl_stream.bus.streams import EVENT_TYPE_HEADER, EventNotAllowed, Topics
from agl_stream.events import Event
from agl_stream.runtime.config import KafkaSettings

log = logging.getLogger(__name__)


class LaneClosed(RuntimeError):
    """The partition's lane ended (fenced by a new owner, failed, or handed back): what was
    sent through it after its last commit is not on the topics."""


class EventTooLarge(ValueError):
    """One event is larger than a produce request may be; only its sender fails."""

    def __init__(self, message: str, size: int, limit: int) -> None:
        super().__init__(message)
        self.size, self.limit = size, limit


CLOSE_SECONDS = 15.0


def transactional_id(group_id: str, tasks_topic: str, partition: int) -> str:
    return f"{group_id}.{tasks_topic}-{partition}"


@dataclass(frozen=True)
class Checkpoint:
    """What a lane commits with the tasks offset: the rollouts offset from which the next
    owner's fold must read (every record at or above the tasks offset has its rollouts
    events at or after it)."""

    rollouts_from: int

    def encode(self) -> str:
        return json.dumps({"rollouts_from": self.rollouts_from})

    @staticmethod
    def decode(metadata: str | None) -> Checkpoint | None:
        try:
            raw = json.loads(metadata or "")
            return Checkpoint(int(raw["rollouts_from"]))
        except (ValueError, TypeError, KeyError):
            return None


@dataclass
class _Pending:
    topic: str  # the full name
    key: bytes
    value: bytes
    event_type: str
    done: asyncio.Future[RecordMetadata] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    def headers(self) -> list[tuple[str, bytes]]:
        return [(EVENT_TYPE_HEADER, self.event_type.encode())]


class Lane:
    def __init__(
        self,
        kafka: KafkaSettings,
        topics: Topics,
        group_id: str,
        partition: int,
        interval: float = 0.05,
        linger_ms: int = 5,
        codec: Codec | None = None,
    ) -> None:
        self.topics = topics
        self.group_id = group_id
        self.tasks = TopicPartition(topics.name("tasks"), partition)
        self.interval = interval
        self._producer = AIOKafkaProducer(
            acks="all",
            enable_idempotence=True,
            transactional_id=transactional_id(group_id, self.tasks.topic, partition),
            linger_ms=linger_ms,
            **kafka.client_options(),
        )
        self._codec = codec or Codec()
        self._pending: list[_Pending] = []
        self._offset: tuple[int, Checkpoint] | None = None
        self._committed: tuple[int, Checkpoint] | None = None
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self.error: BaseException | None = None

    async def open(self) -> None:
        """Start the producer: Kafka fences the partition's previous writer and settles its
        open transaction (aborted) before this returns."""
        await started(self._producer)
        self._task = asyncio.create_task(self._run(), name=f"lane {self.tasks}")

    @property
    def alive(self) -> bool:
        return self.error is None and not self._closing

    async def send(self, short_topic: str, event: Event) -> asyncio.Future[RecordMetadata]:
        """Queue an event for the next transaction; the future resolves once it committed.
        An event that cannot go (not allowed there, not encodable, too large) raises here,
        for its sender alone."""
        (future,) = await self.send_all([(short_topic, event)])
        return future

    async def send_all(
        self, events: list[tuple[str, Event]]
    ) -> list[asyncio.Future[RecordMetadata]]:
        """Queue events that must commit together (an attempt's end and what follows it):
        all go into the same transaction, or none is queued if one of them cannot go."""
        if not self.alive:
            raise LaneClosed(f"the lane of {self.tasks} is closed") from self.error
        batch = [self._pending_for(short_topic, event) for short_topic, event in events]
        self._pending.extend(batch)  # no await since the check: one transaction takes all
        self._wake.set()
        return [pending.done for pending in batch]

    def _pending_for(self, short_topic: str, event: Event) -> _Pending:
        full = self.topics.name(short_topic)
        if not self.topics.allows(full, event.type_name()):
            raise EventNotAllowed(f"{event.type_name()} events do not belong on {full}")
        value = self._codec.encode(event)
        if len(value) > MAX_RECORD_BYTES:
            raise EventTooLarge(
                f"a {event.type_name()} of {len(value):,} bytes is larger than a record may be "
                f"({MAX_RECORD_BYTES:,})",
                len(value),
                MAX_RECORD_BYTES,
            )
        return _Pending(full, event.key.encode(), value, event.type_name())

    def commit(self, offset: int, checkpoint: Checkpoint) -> None:
        """The tasks offset (and fold start) the next transaction records."""
        if self._committed != (offset, checkpoint):
            self._offset = (offset, checkpoint)
            self._wake.set()

    async def close(self) -> None:
        """Commit what is queued, then stop the producer; a lane that cannot commit within
        CLOSE_SECONDS (its coordinator gone) is abandoned: its open transaction is aborted
        by Kafka, when the next owner fences it or when it times out."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            done, _ = await asyncio.wait({self._task}, timeout=CLOSE_SECONDS)
            if not done:
                log.warning(
                    "the lane of %s did not commit within %.0f s", self.tasks, CLOSE_SECONDS
                )
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._producer.stop(), CLOSE_SECONDS)

    async def _run(self) -> None:
        try:
            while True:
                if not self._pending and self._offset is None:
                    if self._closing:
                        return
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await self._transaction()
                if not self._closing:
                    await asyncio.sleep(self.interval)
        except asyncio.CancelledError:
            self._fail(LaneClosed(f"the lane of {self.tasks} was stopped"))
            raise
        except Exception as exc:  # noqa: BLE001 - every failure must reach the runner, never hang it
            log.warning(
                "the lane of %s failed, its uncommitted events are dropped: %r", self.tasks, exc
            )
            self._fail(exc)

    async def _transaction(self) -> None:
        batch, self._pending = self._pending, []
        offset, self._offset = self._offset, None
        await self._producer.begin_transaction()
        try:
            sent = [
                await self._producer.send(
                    p.topic,
                    p.value,
                    key=p.key,
                    headers=[(EVENT_TYPE_HEADER, p.event_type.encode())],
                )
                for p in batch
            ]
            if offset is not None:
                position, checkpoint = offset
                await self._producer.send_offsets_to_transaction(
                    {self.tasks: OffsetAndMetadata(position, checkpoint.encode())}, self.group_id
                )
            metadata = await asyncio.gather(*sent)
            await self._producer.commit_transaction()
        except BaseException:
            self._pending = batch + self._pending  # failed for good below: the futures fail
            raise
        if offset is not None:
            self._committed = offset
        for pending, meta in zip(batch, metadata, strict=True):
            if not pending.done.done():
                pending.done.set_result(meta)

    def _fail(self, error: BaseException) -> None:
        self.error = error
        for pending in self._pending:
            if not pending.done.done():
                pending.done.set_exception(
                    LaneClosed(f"the lane of {self.tasks} failed: {error!r}")
                )
                pending.done.exception()  # retrieved: a caller that stopped waiting is fine
        self._pending = []


async def committed_checkpoint(
    admin: AIOKafkaAdminClient, group_id: str, tasks: TopicPartition
) -> tuple[int | None, Checkpoint | None]:
    """The group's committed tasks offset for the partition and the fold start stored with it."""
    offsets = await admin.list_consumer_group_offsets(group_id, partitions=[tasks])
    found = offsets.get(tasks)
    if found is None or found.offset < 0:
        return None, None
    return found.offset, Checkpoint.decode(found.metadata)


__all__ = ["Checkpoint", "Lane", "LaneClosed", "committed_checkpoint", "transactional_id"]
