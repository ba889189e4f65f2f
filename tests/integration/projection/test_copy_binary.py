"""Spans sent as binary COPY tuples (the compiled reader's and copy_binary.span_tuple's) land
in PostgreSQL as the same rows asyncpg's own encoding of the general path's rows gives; a
batch holding spans already there keeps, for each key, the row recorded first."""

from __future__ import annotations

import contextlib

from agl_stream.bus.codec import Codec
from agl_stream.events import SpanRecorded
from agl_stream.projection.rows import SpanRow, columns
from agl_stream.projection.span_record import span_row_from_datum, span_tuple_from_record
from agl_stream.projection.store import ProjectionStore, active_read_model, connect
from agl_stream.runtime.config import DatabaseSettings
from tests.support.golden import GOLDEN_EVENTS
from tests.support.helpers import examples
from tests.support.strategies import EVENT_STRATEGIES
from tests.support.traffic import traffic
from tests.unit.projection.test_span_record import plain

codec = Codec()


def spans() -> list[SpanRecorded]:
    """Spans of synthetic traffic, the golden span, and text that needs escaping in JSON."""
    out = [e for _, e in traffic(seed=5, rollouts=40) if isinstance(e, SpanRecorded)]
    golden = GOLDEN_EVENTS["SpanRecorded"]
    assert isinstance(golden, SpanRecorded)
    odd = {'quote " \\ back': "tab\t line\n ✓ 😀 \x01", "list": [1.5, -(2**63), None, "é"]}
    out += [golden, golden.model_copy(update={"rollout_id": "ro-odd", "attributes": odd})]
    return out


def general_row(data: bytes) -> SpanRow:
    return span_row_from_datum(plain(data))


async def landed(
    database: DatabaseSettings, sent: list[SpanRow | bytes], rows: list[SpanRow]
) -> tuple[int, int]:
    """Insert `sent` through the store; (spans in the read model, rows that differ from
    asyncpg's own COPY of `rows` into a table like it)."""
    conn = await connect(database.asyncpg_dsn)
    try:
        schema = await active_read_model(conn)
        spans_table = f'"{schema}".spans'
        store = ProjectionStore(conn, schema)
        async with conn.transaction():
            await store.insert_spans(sent)
        await conn.execute(f"CREATE TABLE expected (LIKE {spans_table})")
        await conn.copy_records_to_table("expected", records=rows, columns=columns(SpanRow))
        differing = await conn.fetchval(
            f"SELECT count(*) FROM ((SELECT * FROM {spans_table} EXCEPT ALL "
            f"SELECT * FROM expected) UNION ALL (SELECT * FROM expected EXCEPT ALL "
            f"SELECT * FROM {spans_table})) d"
        )
        return int(await conn.fetchval(f"SELECT count(*) FROM {spans_table}")), int(differing)
    finally:
        await conn.close()


async def test_binary_tuples_land_as_asyncpgs_rows(database: DatabaseSettings) -> None:
    records = [codec.encode(s) for s in spans()]
    fast = [span_tuple_from_record(r) for r in records]
    assert all(f is not None for f in fast), "the compiled reader takes every one of these"
    rows = [general_row(r) for r in records]
    # Half as the reader's tuples, half as SpanRows encoded by copy_binary, one COPY.
    mixed: list[SpanRow | bytes] = [
        f if i % 2 and f is not None else row
        for i, (f, row) in enumerate(zip(fast, rows, strict=True))
    ]
    count, differing = await landed(database, mixed, rows)
    assert count == len(rows)
    assert differing == 0


async def test_a_batch_with_spans_already_there_keeps_the_first_recorded(
    database: DatabaseSettings,
) -> None:
    golden = GOLDEN_EVENTS["SpanRecorded"]
    assert isinstance(golden, SpanRecorded)

    def span(sequence: int, name: str) -> bytes:
        return codec.encode(golden.model_copy(update={"sequence": sequence, "name": name}))

    conn = await connect(database.asyncpg_dsn)
    try:
        schema = await active_read_model(conn)
        store = ProjectionStore(conn, schema)
        first = [span_tuple_from_record(span(0, "first"))]
        async with conn.transaction():
            await store.insert_spans([t for t in first if t is not None])
        batch: list[SpanRow | bytes] = [
            general_row(span(0, "again")),  # already there: stays "first"
            general_row(span(1, "one")),
            *(t for t in [span_tuple_from_record(span(1, "one again"))] if t is not None),
            *(t for t in [span_tuple_from_record(span(2, "two"))] if t is not None),
        ]
        # Twice: the temporary table is emptied for the next batch; once in the caller's
        # transaction (as the projector calls it) and once outside any.
        for outer in (conn.transaction(), contextlib.nullcontext()):
            async with outer:
                await store.insert_spans(batch)
        names = await conn.fetch(f'SELECT sequence, name FROM "{schema}".spans ORDER BY sequence')
        assert [(r["sequence"], r["name"]) for r in names] == [(0, "first"), (1, "one"), (2, "two")]
    finally:
        await conn.close()


async def test_random_spans_land_alike(database: DatabaseSettings) -> None:
    events = examples(EVENT_STRATEGIES["SpanRecorded"], 60)
    records = [codec.encode(e.model_copy(update={"sequence": i})) for i, e in enumerate(events)]
    taken = [(span_tuple_from_record(r), general_row(r)) for r in records]
    fit: list[SpanRow | bytes] = [f for f, _ in taken if f is not None]
    assert fit, "the reader takes most random spans"
    count, differing = await landed(database, fit, [row for f, row in taken if f is not None])
    assert count == len(fit)
    assert differing == 0
