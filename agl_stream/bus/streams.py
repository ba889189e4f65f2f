"""Typed publishing and consuming of events, with bad records routed to the dead-letter topic."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import IllegalStateError
from aiokafka.structs import ConsumerRecord, RecordMetadata

from agl_stream.bus.codec import Codec, Datum, DecodeError
from agl_stream.bus.dead_letters import DeadLetter, dead_letter
from agl_stream.bus.kafka import IDLE_METADATA_AGE_MS, consumer, known_position
from agl_stream.bus.topic_spec import TopicSpec, load_topic_specs
from agl_stream.events import Event
from agl_stream.runtime.config import KafkaSettings

EVENT_TYPE_HEADER = "agl.event_type"
DLQ_TOPIC = "dlq"


class EventNotAllowed(ValueError):
    """An event of this type does not belong on that topic."""


@dataclass(frozen=True)
class ConsumedEvent:
    event: Event
    topic: str
    partition: int
    offset: int
    timestamp_ms: int | None
    headers: tuple[tuple[str, bytes], ...] = ()


@dataclass(frozen=True)
class Converted:
    """A record a converter made into something other than an event (see EventStream), with
    the record's bytes and headers (kept for its dead letter, should it need one)."""

    value: Any
    event_type: str
    offset: int
    timestamp_ms: int | None
    record: bytes | None = None
    headers: tuple[tuple[str, bytes], ...] = ()


@dataclass(frozen=True)
class Converter:
    """How a stream takes records of one event type instead of event models: `from_datum`
    gets the plain Avro datum (Codec.decode_datum) and returns the value, or raises
    ValueError to dead-letter the record as invalid; `from_record`, where given, is tried
    first on the record's bytes and returns the value, or None to leave the record to
    `from_datum` (it never refuses a record itself)."""

    from_datum: Callable[[Datum], Any]
    from_record: Callable[[bytes], Any] | None = None


@dataclass
class Batch:
    """Events that decoded (and records converters took), and the offset to commit per
    partition (past the dead letters)."""

    events: dict[TopicPartition, list[ConsumedEvent]] = field(default_factory=dict)
    converted: dict[TopicPartition, list[Converted]] = field(default_factory=dict)
    next_offsets: dict[TopicPartition, int] = field(default_factory=dict)
    first_offsets: dict[TopicPartition, int] = field(default_factory=dict)
    dead_lettered: int = 0

    def __iter__(self) -> Iterator[ConsumedEvent]:
        for events in self.events.values():
            yield from events

    def __len__(self) -> int:
        return sum(len(v) for v in self.events.values())

    def records(self) -> int:
        """Events and converted records together."""
        return len(self) + sum(len(v) for v in self.converted.values())

    def split(self) -> tuple[Batch, Batch]:
        """Two batches that are this one in order, each with about half its records: its
        partitions in two groups, or with one partition, its records before and from an
        offset (the first half's next offset is where the second starts). For a batch of
        two records or more."""
        with_records = [
            tp for tp in self.next_offsets if self.events.get(tp) or self.converted.get(tp)
        ]
        if len(with_records) > 1:
            first_group = set(with_records[: len(with_records) // 2])
            first, second = Batch(dead_lettered=self.dead_lettered), Batch()
            for tp in self.next_offsets:
                part = first if tp in first_group or tp not in with_records else second
                part._take(self, tp)
            return first, second
        tp = with_records[0]
        offsets = sorted(
            [e.offset for e in self.events.get(tp, ())]
            + [c.offset for c in self.converted.get(tp, ())]
        )
        cut = offsets[len(offsets) // 2]
        first, second = Batch(dead_lettered=self.dead_lettered), Batch()
        for other in self.next_offsets:
            if other != tp:
                first._take(self, other)
        first.events[tp] = [e for e in self.events.get(tp, ()) if e.offset < cut]
        first.converted[tp] = [c for c in self.converted.get(tp, ()) if c.offset < cut]
        first.next_offsets[tp] = cut
        if tp in self.first_offsets:
            first.first_offsets[tp] = self.first_offsets[tp]
        second.events[tp] = [e for e in self.events.get(tp, ()) if e.offset >= cut]
        second.converted[tp] = [c for c in self.converted.get(tp, ()) if c.offset >= cut]
        second.next_offsets[tp] = self.next_offsets[tp]
        second.first_offsets[tp] = cut
        return first, second

    def without_records(self) -> Batch:
        """The same offsets to advance to, with no record to apply (what is left of a batch
        whose one record was dead-lettered)."""
        return Batch(
            next_offsets=dict(self.next_offsets),
            first_offsets=dict(self.first_offsets),
            dead_lettered=self.dead_lettered,
        )

    def _take(self, other: Batch, tp: TopicPartition) -> None:
        """Partition `tp` of `other`, whole."""
        if tp in other.events:
            self.events[tp] = other.events[tp]
        if tp in other.converted:
            self.converted[tp] = other.converted[tp]
        self.next_offsets[tp] = other.next_offsets[tp]
        if tp in other.first_offsets:
            self.first_offsets[tp] = other.first_offsets[tp]


class Topics:
    """Short topic names (tasks) to full names (agl.tasks), and which events each carries."""

    def __init__(self, settings: KafkaSettings, specs: Mapping[str, TopicSpec] | None = None):
        self.prefix = settings.topic_prefix
        self.specs = dict(specs if specs is not None else load_topic_specs())
        self._by_full = {s.full_name(self.prefix): s for s in self.specs.values()}

    def name(self, short: str) -> str:
        return self.specs[short].full_name(self.prefix)

    def spec_of(self, full_name: str) -> TopicSpec | None:
        return self._by_full.get(full_name)

    def allows(self, full_name: str, event_type: str) -> bool:
        spec = self.spec_of(full_name)
        return spec is not None and event_type in spec.events


# A record's own framing in a batch (lengths, attributes, offsets, timestamp; the batch's
# header counts too when it holds one record), over its key, value and headers.
RECORD_OVERHEAD = 128


class Sender(Protocol):
    """What publishes an attempt's events: an EventPublisher, or a runner's partition lane."""

    async def send(self, short_topic: str, event: Event) -> asyncio.Future[RecordMetadata]: ...


@dataclass(frozen=True)
class Prepared:
    """An event encoded as the record it goes out as."""

    topic: str
    value: bytes
    key: bytes
    headers: tuple[tuple[str, bytes], ...]

    @property
    def size(self) -> int:
        """Its size as the producer counts it against max_request_size, about."""
        extra = sum(len(name) + len(value) for name, value in self.headers)
        return len(self.value) + len(self.key) + extra + RECORD_OVERHEAD


class EventPublisher:
    """Encodes events and sends them keyed by their partitioning key, acks=all."""

    def __init__(self, producer: AIOKafkaProducer, topics: Topics, codec: Codec | None = None):
        self._producer = producer
        self._topics = topics
        self._codec = codec or Codec()

    def prepare(self, short_topic: str, event: Event) -> Prepared:
        """The event as the record it will be (refused here if it does not belong on the
        topic), to send later."""
        full = self._topics.name(short_topic)
        if not self._topics.allows(full, event.type_name()):
            raise EventNotAllowed(f"{event.type_name()} events do not belong on {full}")
        return Prepared(
            full,
            self._codec.encode(event),
            event.key.encode(),
            ((EVENT_TYPE_HEADER, event.type_name().encode()),),
        )

    async def send_prepared(self, record: Prepared) -> asyncio.Future[RecordMetadata]:
        future: asyncio.Future[RecordMetadata] = await self._producer.send(
            record.topic, record.value, key=record.key, headers=list(record.headers)
        )
        return future

    async def send(self, short_topic: str, event: Event) -> asyncio.Future[RecordMetadata]:
        """Queue one event; the future resolves when the broker has it."""
        return await self.send_prepared(self.prepare(short_topic, event))

    async def publish(self, short_topic: str, event: Event) -> RecordMetadata:
        return await (await self.send(short_topic, event))

    async def publish_many(self, short_topic: str, events: Iterable[Event]) -> list[RecordMetadata]:
        futures = [await self.send(short_topic, e) for e in events]
        return list(await asyncio.gather(*futures))


class EventStream:
    """Reads records through a consumer and decodes them. Records that are undecodable, of
    an unknown schema, invalid, or of a type that does not belong on their topic go to the
    dead-letter topic (or, with no producer, are only counted: a replay reads records whose
    dead letters were sent when they were first consumed), and the stream moves on. Dead
    letters are on the broker before a batch is returned, so committing the batch's
    next_offsets never loses a record.

    `converters` take records of the named event types instead of the event models (see
    Converter); the batch keeps what they return in `converted`."""

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        producer: AIOKafkaProducer | None,
        topics: Topics,
        consumer_name: str,
        codec: Codec | None = None,
        converters: Mapping[str, Converter] | None = None,
    ) -> None:
        self._consumer = consumer
        self._producer = producer
        self._topics = topics
        self._name = consumer_name
        self._codec = codec or Codec()
        self._converters = dict(converters or {})
        self._after: dict[TopicPartition, int] = {}

    async def next_batch(self, timeout_ms: int = 1000, max_records: int | None = None) -> Batch:
        records = await self._consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        batch = Batch()
        pending: list[asyncio.Future[RecordMetadata]] = []
        for tp, items in records.items():
            if items:
                # Where this read started: right after the last batch (unless a seek moved
                # it), which is below the first record when non-records lie between them.
                after = self._after.get(tp)
                started = after if after is not None and after <= items[0].offset else None
                batch.first_offsets[tp] = items[0].offset if started is None else started
            good: list[ConsumedEvent] = []
            converted: list[Converted] = []
            for record in items:
                consumed, letter = self._decode(record)
                if isinstance(consumed, ConsumedEvent):
                    good.append(consumed)
                elif isinstance(consumed, Converted):
                    converted.append(consumed)
                elif letter is not None and self._producer is not None:
                    pending.append(await self._send_dead_letter(letter))
                else:
                    batch.dead_lettered += 1
                batch.next_offsets[tp] = record.offset + 1
            if items:
                # Past what follows the last record and is no record of its own
                # (transaction markers, aborted records): the reader's position.
                with contextlib.suppress(IllegalStateError):  # revoked meanwhile
                    position = await self._consumer.position(tp)
                    batch.next_offsets[tp] = max(batch.next_offsets[tp], position)
                self._after[tp] = batch.next_offsets[tp]
            if good:
                batch.events[tp] = good
            if converted:
                batch.converted[tp] = converted
        if pending:
            await asyncio.gather(*pending)
            batch.dead_lettered += len(pending)
        self._moved_without_records(batch, {tp for tp, items in records.items() if items})
        return batch

    def _moved_without_records(self, batch: Batch, read: set[TopicPartition]) -> None:
        """A fetch can move a partition's position with no record to hand over: past an
        aborted transaction, or past a transaction marker that came after its records. The
        batch says so (a position and no events), or its reader would stay short of the end
        for good (a lag that never closes, a catch-up that never ends)."""
        for tp in self._consumer.assignment() - read:
            position = known_position(self._consumer, tp)
            after = self._after.get(tp)
            if position is None or (after is not None and position <= after):
                continue  # not known yet, or not moved (a seek back sets where reads start)
            if after is not None:
                batch.first_offsets[tp] = after
            batch.next_offsets[tp] = position
            self._after[tp] = position

    def seek(self, tp: TopicPartition, offset: int) -> None:
        """Read the partition from `offset` on (use this rather than the consumer's seek, so
        the next batch knows where its read started)."""
        self._consumer.seek(tp, offset)
        self._after[tp] = offset

    def forget(self, tp: TopicPartition) -> None:
        """Where the partition's next read starts is not known (a seek to its beginning)."""
        self._after.pop(tp, None)

    async def position(self, tp: TopicPartition) -> int:
        """The offset of the next record this stream reads from the partition."""
        position: int = await self._consumer.position(tp)
        return position

    async def commit(self, batch: Batch) -> None:
        if batch.next_offsets:
            await self._consumer.commit(dict(batch.next_offsets))

    def _decode(
        self, record: ConsumerRecord
    ) -> tuple[ConsumedEvent | Converted | None, DeadLetter | None]:
        headers = tuple(record.headers or ())
        try:
            item: ConsumedEvent | Converted | None = (
                self._convert(record) if self._converters else None
            )
            if item is None:
                event = self._codec.decode(record.value)
                item = ConsumedEvent(
                    event, record.topic, record.partition, record.offset, record.timestamp, headers
                )
        except DecodeError as exc:
            return None, self._letter(record, headers, exc.reason, exc.kind)
        event_type = item.event_type if isinstance(item, Converted) else item.event.type_name()
        if not self._topics.allows(record.topic, event_type):
            reason = f"{event_type} events do not belong on {record.topic}"
            return None, self._letter(record, headers, reason, "wrong_topic")
        return item, None

    def _convert(self, record: ConsumerRecord) -> Converted | None:
        """The record through its type's converter; None when its type has none (it is then
        decoded as an event, from the same bytes: the header names the schema)."""
        event_type = self._codec.event_type_of(record.value)
        convert = self._converters.get(event_type or "")
        if convert is None or event_type is None:
            return None
        value = None if convert.from_record is None else convert.from_record(record.value)
        if value is None:
            writer, datum = self._codec.decode_datum(record.value, plain=True)
            try:
                value = convert.from_datum(datum)
            except (ValueError, TypeError, KeyError) as exc:
                raise DecodeError(f"invalid {writer.event_type}: {exc}", "invalid") from exc
        return Converted(
            value, event_type, record.offset, record.timestamp, record.value,
            tuple(record.headers or ()),
        )  # fmt: skip

    def _letter(
        self, record: ConsumerRecord, headers: tuple[tuple[str, bytes], ...], reason: str, kind: str
    ) -> DeadLetter:
        return dead_letter(
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            timestamp_ms=record.timestamp,
            value=record.value,
            headers=headers,
            reason=reason,
            kind=kind,
            consumer=self._name,
        )

    async def _send_dead_letter(self, letter: DeadLetter) -> asyncio.Future[RecordMetadata]:
        assert self._producer is not None
        future: asyncio.Future[RecordMetadata] = await self._producer.send(
            self._topics.name(DLQ_TOPIC), letter.value, key=letter.key, headers=letter.headers
        )
        return future


async def read_records(
    kafka: KafkaSettings,
    starts: Mapping[TopicPartition, int],
    ends: Mapping[TopicPartition, int],
) -> AsyncIterator[ConsumerRecord]:
    """The raw committed records of each partition from its start offset up to (not
    including) its end, through a consumer of their own."""
    async with consumer(kafka) as reader:
        async for record in records_with(reader, starts, ends):
            yield record


# The fetch wait of a reader kept for many reads. A broker answers a connection's requests
# one at a time, so a fetch still long-polling at the end of a read (500 ms by default) would
# hold up the next read's first request (its end offsets) until it returned.
READER_FETCH_WAIT_MS = 10


def reusable_reader(
    kafka: KafkaSettings,
) -> contextlib.AbstractAsyncContextManager[AIOKafkaConsumer]:
    """A consumer with no group to keep for many reads (records_with, read_partition_with),
    idle in between (IDLE_METADATA_AGE_MS)."""
    return consumer(
        kafka, fetch_max_wait_ms=READER_FETCH_WAIT_MS, metadata_max_age_ms=IDLE_METADATA_AGE_MS
    )


async def records_with(
    reader: AIOKafkaConsumer,
    starts: Mapping[TopicPartition, int],
    ends: Mapping[TopicPartition, int],
) -> AsyncIterator[ConsumerRecord]:
    """read_records through `reader`, a consumer kept for many reads (reusable_reader):
    assigned the partitions for this one, and paused at its end (it fetches nothing more
    until the next read assigns it again). Done with a partition when the reader's position
    reaches the end, not when a record at end - 1 arrives: the last offsets may hold no
    record (transaction markers, aborted records), and retention may have removed every
    record (a start below the log start moves to it)."""
    pending = {tp for tp in starts if ends[tp] > starts[tp]}
    reader.assign(list(starts))
    for tp, offset in starts.items():
        reader.seek(tp, offset)
    try:
        while pending:
            # Short polls: a partition whose last offsets are commit markers returns no
            # record for them (its position moves past them), so a poll waits its timeout.
            batch = await reader.getmany(*pending, timeout_ms=20)
            for tp, records in batch.items():
                for record in records:
                    if record.offset < ends[tp]:
                        yield record
            for tp in list(pending):
                if await reader.position(tp) >= ends[tp]:
                    pending.discard(tp)
    finally:
        reader.pause(*reader.assignment())


async def read_partitions(
    kafka: KafkaSettings,
    partitions: list[TopicPartition],
    ends_out: dict[TopicPartition, int] | None = None,
) -> list[Event]:
    """Every decodable event of the partitions, from their start to their current end
    (undecodable records are skipped: the consumers that own the topic dead-letter them)."""
    events, ends = await _read_events(kafka, dict.fromkeys(partitions, 0))
    if ends_out is not None:
        ends_out.update(ends)
    return [event for _, event in events]


async def _read_events(
    kafka: KafkaSettings, starts: Mapping[TopicPartition, int]
) -> tuple[list[tuple[int, Event]], dict[TopicPartition, int]]:
    """The decodable events (with their offsets) from each start to each partition's end now."""
    if not starts:
        return [], {}
    async with consumer(kafka) as reader:
        return await _events_with(reader, starts)


async def _events_with(
    reader: AIOKafkaConsumer, starts: Mapping[TopicPartition, int]
) -> tuple[list[tuple[int, Event]], dict[TopicPartition, int]]:
    ends: dict[TopicPartition, int] = await reader.end_offsets(list(starts))
    codec = Codec()
    events: list[tuple[int, Event]] = []
    async for record in records_with(reader, starts, ends):
        with contextlib.suppress(DecodeError):
            events.append((record.offset, codec.decode(record.value)))
    return events, ends


async def read_partition_from(
    kafka: KafkaSettings, tp: TopicPartition, start: int
) -> tuple[list[tuple[int, Event]], int]:
    """The decodable events of one partition from `start` to its current end, with their
    offsets, and that end."""
    events, ends = await _read_events(kafka, {tp: start})
    return events, ends[tp]


async def read_partition_with(
    reader: AIOKafkaConsumer, tp: TopicPartition, start: int
) -> tuple[list[tuple[int, Event]], int]:
    """read_partition_from through `reader`, a consumer with no group that may serve many
    reads (reusable_reader)."""
    events, ends = await _events_with(reader, {tp: start})
    return events, ends[tp]
