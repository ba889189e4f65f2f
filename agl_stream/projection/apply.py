"""One projection step: a decoded batch into one read-model schema, exactly once.

The stored next offset of every partition in the batch is locked; records below it were
applied already (a restart, or another projector during a rebalance) and are skipped; rows
and the new offsets commit together. Nothing here knows about consumer groups.
Spans come as rows already (CONVERTERS: the stream builds them from the Avro data, most as
binary COPY tuples).

A batch the database refuses because of what a record holds (RECORD_FAULTS: a value out of
a column's range, an index row too large, a constraint) is applied again in halves, down to
the record at fault, which is dead-lettered with the database's reason; everything else is
projected. A database that is down or gone is no record's fault: that error is raised.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field

import asyncpg
import asyncpg.exceptions._base
import orjson

from agl_stream.bus.codec import Codec
from agl_stream.bus.streams import Batch, ConsumedEvent, Converted, Converter
from agl_stream.events import AttemptFinished, AttemptStarted, RewardRecorded
from agl_stream.events.reward_rules import late_reward_refusal, record_time
from agl_stream.projection.fold import State, keys, project
from agl_stream.projection.rows import SpanRow
from agl_stream.projection.span_record import span_row_from_datum, span_tuple_from_record
from agl_stream.projection.store import Partition, ProjectionStore, active_read_model

log = logging.getLogger(__name__)

# Errors of a write that the records' content causes, not the database's state: the same
# records fail the same way at every try. Server side (SQLSTATE classes 22, 23 and 54) and
# client side (asyncpg's argument encoding, orjson's, a number too large for its column).
RECORD_FAULTS: tuple[type[BaseException], ...] = (
    asyncpg.DataError,
    asyncpg.IntegrityConstraintViolationError,
    asyncpg.ProgramLimitExceededError,
    asyncpg.exceptions._base.DataError,
    orjson.JSONEncodeError,
    OverflowError,
    UnicodeEncodeError,
)
UNPROJECTABLE = "unprojectable"
Where = tuple[str, int, int]  # topic, partition, offset


@dataclass(frozen=True)
class Refused:
    """A record the projection does not take: where it is, its bytes, and why."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    kind: str
    reason: str


# Sends one record's dead letter and waits for the broker.
DeadLetterSink = Callable[[Refused], Awaitable[None]]

# What the projector's and the replay's streams hand over as rows, not as event models.
CONVERTERS = {"SpanRecorded": Converter(span_row_from_datum, span_tuple_from_record)}


@dataclass(frozen=True)
class Applied:
    events: int
    spans: int
    rows: int
    refused_rewards: int = 0
    unprojectable: int = 0  # records the database refused, dead-lettered

    def __add__(self, other: Applied) -> Applied:
        return Applied(
            self.events + other.events, self.spans + other.spans, self.rows + other.rows,
            self.refused_rewards + other.refused_rewards,
            self.unprojectable + other.unprojectable,
        )  # fmt: skip


@dataclass(frozen=True)
class Switched:
    """The active read model changed (a replay finished): follow it."""

    schema: str


@dataclass(frozen=True)
class Behind:
    """The database holds an offset below where the consumer stands: seek back to it."""

    offsets: dict[Partition, int]


Outcome = Applied | Switched | Behind


@dataclass
class Projection:
    """Applies batches to `schema`; `follow_active` makes it check, in each transaction,
    that the schema is still the one queries read."""

    conn: asyncpg.Connection
    schema: str
    follow_active: bool = True
    # Where rewards that do not count and records the database refuses go (None: a replay,
    # whose records were dead-lettered when the live projector first read them).
    dead_letters: DeadLetterSink | None = None
    # Where the consumer stands per partition (None: from the beginning, nothing stored).
    positions: dict[Partition, int | None] = field(default_factory=dict)
    store: ProjectionStore = field(init=False)

    def __post_init__(self) -> None:
        self.store = ProjectionStore(self.conn, self.schema)

    def follow(self, schema: str) -> None:
        """Write to another read model from now on (the caller seeks to its offsets)."""
        self.schema = schema
        self.store = ProjectionStore(self.conn, schema)

    async def apply(
        self, batch: Batch, ends: Mapping[Partition, int], lettered: set[Where] | None = None
    ) -> Outcome:
        """The batch in one transaction; where the database refuses a record of it, the
        batch in parts, with that record dead-lettered (see the module's docstring).
        `lettered`: records whose dead letters are sent already (by a try of a larger part)."""
        lettered = set() if lettered is None else lettered
        try:
            return await self._apply_once(batch, ends, lettered)
        except RECORD_FAULTS as exc:
            if batch.records() == 0:
                raise
            fault = exc
        if batch.records() == 1:
            await self._refuse_only_record(batch, fault)
            outcome = await self._apply_once(batch.without_records(), ends, lettered)
            if isinstance(outcome, Applied):
                return outcome + Applied(0, 0, 0, unprojectable=1)
            return outcome
        first, second = batch.split()
        done = await self.apply(first, ends, lettered)
        if not isinstance(done, Applied):
            return done
        rest = await self.apply(second, ends, lettered)
        return done + rest if isinstance(rest, Applied) else rest

    async def _refuse_only_record(self, batch: Batch, fault: BaseException) -> None:
        reason = f"the read model cannot hold this record: {type(fault).__name__}: {fault}"
        [refused] = [refusal_of_event(item, UNPROJECTABLE, reason) for item in batch] + [
            refusal_of_converted(tp.topic, tp.partition, item, UNPROJECTABLE, reason)
            for tp, items in batch.converted.items()
            for item in items
        ]
        log.warning(
            "%s[%d] at offset %d is dead-lettered: %s",
            refused.topic, refused.partition, refused.offset, reason,
        )  # fmt: skip
        if self.dead_letters is not None:
            await self.dead_letters(refused)

    async def _apply_once(
        self, batch: Batch, ends: Mapping[Partition, int], lettered: set[Where]
    ) -> Outcome:
        store = self.store
        advanced: dict[Partition, int] = {}
        async with self.conn.transaction():
            if self.follow_active:
                active = await active_read_model(self.conn, lock=True)
                if active != self.schema:
                    return Switched(active)
            partitions = {(tp.topic, tp.partition): tp for tp in batch.next_offsets}
            stored = await store.lock_offsets(partitions)
            behind = {
                p: offset
                for p, offset in stored.items()
                if (position := self.positions.get(p)) is not None and offset < position
            }
            # A batch that starts past where the database stands would leave a hole.
            for p, tp in partitions.items():
                expected = stored.get(p, self.positions.get(p))
                first = batch.first_offsets.get(tp)
                if expected is not None and first is not None and first > expected:
                    behind[p] = expected
            if behind:
                return Behind(behind)
            consumed: list[ConsumedEvent] = []
            span_rows: list[SpanRow | bytes] = []
            for p, tp in partitions.items():
                floor = stored.get(p, -1)
                if batch.next_offsets[tp] <= floor:
                    continue  # all of it is in the database already
                consumed.extend(c for c in batch.events.get(tp, ()) if c.offset >= floor)
                span_rows.extend(c.value for c in batch.converted.get(tp, ()) if c.offset >= floor)
                advanced[p] = batch.next_offsets[tp]
            if not advanced:
                return Applied(0, 0, 0)
            state = await store.load(keys(c.event for c in consumed))
            refused = refused_rewards(consumed, state)
            if refused and self.dead_letters is not None:
                for where, (item, kind, reason) in refused.items():
                    if where not in lettered:  # on the broker before the commit
                        await self.dead_letters(refusal_of_event(item, kind, reason))
                        lettered.add(where)
            events = [c.event for c in consumed if _where(c) not in refused]
            changes = project(events, state)
            changes.spans.extend(span_rows)
            await store.write(changes)
            await store.save_offsets(advanced, ends)
        self.positions.update(advanced)
        return Applied(len(events) + len(span_rows), len(changes.spans), len(changes), len(refused))


def _where(item: ConsumedEvent) -> Where:
    return (item.topic, item.partition, item.offset)


def refusal_of_event(item: ConsumedEvent, kind: str, reason: str) -> Refused:
    return Refused(
        item.topic, item.partition, item.offset, item.timestamp_ms, Codec().encode(item.event),
        item.headers, kind, reason,
    )  # fmt: skip


def refusal_of_converted(
    topic: str, partition: int, item: Converted, kind: str, reason: str
) -> Refused:
    return Refused(
        topic, partition, item.offset, item.timestamp_ms, item.record, item.headers, kind, reason
    )


def refused_rewards(
    consumed: Iterable[ConsumedEvent], state: State
) -> dict[Where, tuple[ConsumedEvent, str, str]]:
    """The batch's rewards that do not count (late_reward_refusal), each with its dead
    letter's kind and reason. What lies before a record in its partition: the attempts the
    database holds (all from lower offsets: a rollout lives in one partition) and those
    earlier in the batch (each partition's records come in offset order)."""
    before: dict[str, set[str]] = {}
    for rollout_id, attempt_id in state.attempts:
        before.setdefault(rollout_id, set()).add(attempt_id)
    refused: dict[Where, tuple[ConsumedEvent, str, str]] = {}
    for item in consumed:
        event = item.event
        if isinstance(event, AttemptStarted | AttemptFinished):
            before.setdefault(event.rollout_id, set()).add(event.attempt_id)
        elif isinstance(event, RewardRecorded):
            recorded_at = None if item.timestamp_ms is None else record_time(item.timestamp_ms)
            why = late_reward_refusal(
                event.rollout_id, event.attempt_id, before.get(event.rollout_id, set()),
                event.occurred_at, recorded_at,
            )  # fmt: skip
            if why is not None:
                refused[_where(item)] = (item, *why)
    return refused
