"""Spans sent as binary COPY tuples (the compiled reader's and copy_binary.span_tuple's) land
in PostgreSQL as the same rows asyncpg's own encoding of the general path's rows gives; a
batch holding spans already there keeps, for each key, the row recorded first."""

from __future__ import annotations

import contextlib
import random

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agl_stream.codec import Codec
from agl_stream.config import DatabaseSettings
from agl_stream.events import SpanRecorded
from agl_stream.projection.rows import SpanRow, columns
from agl_stream.projection.span_record import span_row_from_datum, span_tuple_from_record
from agl_stream.projection.store import ProjectionStore, active_read_model, connect
from tests.traffic import traffic
from tests.unit.golden import GOLDEN_EVENTS
from tests.unit.strategies import EVENT_STRATEGIES

codec = Codec()
KEYS = "rollout_id, attempt_id, sequence"


def spans() -> list[SpanRecorded]:
    """Spans of synthetic traffic, the golden span, and text that needs escaping in JSON."""
    out = [e for _, e in traffic(seed=5, rollouts=40) if isinstance(e, SpanRecorded)]
    golden = GOLDEN_EVENTS["SpanRecorded"]
    assert isinstance(golden, SpanRecorded)
    odd = {'quote " \\ back': "tab\t line\n ✓ 😀 \x01", "list": [1.5, -(2**63), None, "é"]}
    out += [golden, golden.model_copy(update={"rollout_id": "ro-odd", "attributes": odd})]
    return out


def general_row(data: bytes) -> SpanRow:
    return span_row_from_datum(codec.decode_datum(data, plain=True)[1])


async def differences(conn: asyncpg.Connection, a: str, b: str) -> int:
    count = await conn.fetchval(
        f"SELECT count(*) FROM ((SELECT * FROM {a} EXCEPT ALL SELECT * FROM {b}) UNION ALL "
        f"(SELECT * FROM {b} EXCEPT ALL SELECT * FROM {a})) d"
    )
    return int(count)


async def test_binary_tuples_land_as_asyncpgs_rows(database: DatabaseSettings) -> None:
    records = [codec.encode(s) for s in spans()]
    fast = [span_tuple_from_record(r) for r in records]
    assert all(f is not None for f in fast), "the compiled reader takes every one of these"
    conn = await connect(database.asyncpg_dsn)
    try:
        schema = await active_read_model(conn)
        store = ProjectionStore(conn, schema)
        rows = [general_row(r) for r in records]
        # Half as the reader's tuples, half as SpanRows encoded by copy_binary, one COPY.
        mixed: list[SpanRow | bytes] = [
            f if i % 2 else row for i, (f, row) in enumerate(zip(fast, rows, strict=True))
        ]
        async with conn.transaction():
            await store.insert_spans(mixed)
        await conn.execute(f'CREATE TABLE expected (LIKE "{schema}".spans)')
        await conn.copy_records_to_table("expected", records=rows, columns=columns(SpanRow))
        assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".spans') == len(rows)
        assert await differences(conn, f'"{schema}".spans', "expected") == 0
    finally:
        await conn.close()


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


@pytest.mark.parametrize("seed", [1, 2])
async def test_random_spans_land_alike(database: DatabaseSettings, seed: int) -> None:
    rng = random.Random(seed)
    strategy = st.lists(EVENT_STRATEGIES["SpanRecorded"], min_size=30, max_size=30)
    drawn: list[list[SpanRecorded]] = []

    @settings(max_examples=1, database=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def draw(events: list[SpanRecorded]) -> None:
        drawn.append(events)

    draw._hypothesis_internal_use_seed = rng.getrandbits(32)  # type: ignore[attr-defined]
    draw()
    events = [e.model_copy(update={"sequence": i}) for i, e in enumerate(drawn[0])]
    records = [codec.encode(e) for e in events]
    conn = await connect(database.asyncpg_dsn)
    try:
        schema = await active_read_model(conn)
        store = ProjectionStore(conn, schema)
        taken = [(r, span_tuple_from_record(r)) for r in records]
        rows = [general_row(r) for r, _ in taken]
        fit = [f for _, f in taken if f is not None]
        assert fit, "the reader takes most random spans"
        expected = [row for row, (_, f) in zip(rows, taken, strict=True) if f is not None]
        async with conn.transaction():
            await store.insert_spans(fit)
        await conn.execute(f'CREATE TABLE expected (LIKE "{schema}".spans)')
        await conn.copy_records_to_table("expected", records=expected, columns=columns(SpanRow))
        assert await differences(conn, f'"{schema}".spans', "expected") == 0
    finally:
        await conn.close()
