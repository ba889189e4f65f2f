"""One projection step: a decoded batch into one read-model schema, exactly once.

The stored next offset of every partition in the batch is locked; records below it were
applied already (a restart, or another projector during a rebalance) and are skipped; rows
and the new offsets commit together. Nothing here knows about consumer groups.
Spans come as rows already (CONVERTERS: the stream builds them from the Avro data, most as
binary COPY tuples).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field

import asyncpg

from agl_stream.events import AttemptFinished, AttemptStarted, RewardRecorded
from agl_stream.projection.fold import State, keys, project
from agl_stream.projection.rows import SpanRow
from agl_stream.projection.span_record import span_row_from_datum, span_tuple_from_record
from agl_stream.projection.store import Partition, ProjectionStore, active_read_model
from agl_stream.rewards import late_reward_refusal
from agl_stream.streams import Batch, ConsumedEvent, Converter

# Sends one record's dead letter (the record, its kind, the reason) and waits for the broker.
DeadLetterSink = Callable[[ConsumedEvent, str, str], Awaitable[None]]

# What the projector's and the replay's streams hand over as rows, not as event models.
CONVERTERS = {"SpanRecorded": Converter(span_row_from_datum, span_tuple_from_record)}


@dataclass(frozen=True)
class Applied:
    events: int
    spans: int
    rows: int
    refused_rewards: int = 0


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
    # Where rewards that do not count go (None: a replay, whose records were dead-lettered
    # when the live projector first read them).
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

    async def apply(self, batch: Batch, ends: Mapping[Partition, int]) -> Outcome:
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
                for item, kind, reason in refused.values():
                    await self.dead_letters(item, kind, reason)  # on the broker before commit
            events = [c.event for c in consumed if _where(c) not in refused]
            changes = project(events, state)
            changes.spans.extend(span_rows)
            await store.write(changes)
            await store.save_offsets(advanced, ends)
        self.positions.update(advanced)
        return Applied(len(events) + len(span_rows), len(changes.spans), len(changes), len(refused))


Where = tuple[str, int, int]  # topic, partition, offset


def _where(item: ConsumedEvent) -> Where:
    return (item.topic, item.partition, item.offset)


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
            why = late_reward_refusal(
                event.rollout_id, event.attempt_id, before.get(event.rollout_id, set())
            )
            if why is not None:
                refused[_where(item)] = (item, *why)
    return refused
