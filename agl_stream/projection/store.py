"""The projection's rows and offsets in PostgreSQL (asyncpg): load what a batch touches,
write what changed, fence and advance the offsets, all inside the caller's transaction."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import asyncpg
import orjson

from agl_stream.projection import pg_text
from agl_stream.projection.copy_binary import COLUMNS as COPY_COLUMNS
from agl_stream.projection.copy_binary import copy_data
from agl_stream.projection.fold import Changes, Keys, State
from agl_stream.projection.rows import (
    AglRecordRow,
    AttemptRow,
    ResourcesRow,
    RewardRow,
    RolloutRow,
    Row,
    SpanRow,
    WorkerRow,
    columns,
    values,
)

NOTIFY_CHANNEL = "agl_projection"
Partition = tuple[str, int]

_KEYS: dict[type[Row], tuple[str, ...]] = {
    RolloutRow: ("rollout_id",),
    AttemptRow: ("rollout_id", "attempt_id"),
    SpanRow: ("rollout_id", "attempt_id", "sequence"),
    ResourcesRow: ("resources_id",),
    WorkerRow: ("worker_id",),
    RewardRow: ("rollout_id", "event_id"),
    AglRecordRow: ("kind", "rollout_id", "record_id"),
}
_TABLES: dict[type[Row], str] = {
    RolloutRow: "rollouts",
    AttemptRow: "attempts",
    SpanRow: "spans",
    ResourcesRow: "resources",
    WorkerRow: "workers",
    RewardRow: "rewards",
    AglRecordRow: "agl_records",
}


async def init_connection(conn: asyncpg.Connection) -> None:
    """jsonb through orjson in binary format (version byte 1, then the JSON text), NULs
    replaced as pg_text says."""
    await conn.set_type_codec(
        "jsonb",
        schema="pg_catalog",
        encoder=pg_text.jsonb,
        decoder=lambda data: orjson.loads(data[1:]),
        format="binary",
    )


async def connect(dsn: str) -> asyncpg.Connection:
    conn = await asyncpg.connect(dsn)
    await init_connection(conn)
    return conn


class ProjectionStore:
    """One read-model schema, through one connection (the caller owns the transaction)."""

    def __init__(self, conn: asyncpg.Connection, schema: str) -> None:
        self.conn = conn
        self.schema = schema
        self._upserts = {t: self._upsert_sql(t) for t in _TABLES if t not in (SpanRow, RewardRow)}
        # A reward is one event: the first row stored for its id stays.
        self._upserts[RewardRow] = self._insert_sql(RewardRow)

    def table(self, row_type: type[Row] | str) -> str:
        name = row_type if isinstance(row_type, str) else _TABLES[row_type]
        return f'"{self.schema}".{name}'

    # ---- rows ----------------------------------------------------------------------------

    async def load(self, keys: Keys) -> State:
        """The rows a batch touches, locked until the transaction ends (sorted keys: no
        deadlock between two projectors during a rebalance)."""
        state = State()
        if keys.rollouts:
            ids = sorted(keys.rollouts)
            for r in await self._select(RolloutRow, "rollout_id", ids):
                state.rollouts[r.rollout_id] = r
            for a in await self._select(AttemptRow, "rollout_id", ids):
                state.attempts[(a.rollout_id, a.attempt_id)] = a
        if keys.resources:
            for res in await self._select(ResourcesRow, "resources_id", sorted(keys.resources)):
                state.resources[res.resources_id] = res
        if keys.workers:
            for w in await self._select(WorkerRow, "worker_id", sorted(keys.workers)):
                state.workers[w.worker_id] = w
        if keys.agl_records:
            ids = sorted({record_id for _, _, record_id in keys.agl_records})
            for rec in await self._select(AglRecordRow, "record_id", ids):
                key = (rec.kind, rec.rollout_id, rec.record_id)
                if key in keys.agl_records:
                    state.agl_records[key] = rec
        return state

    async def _select(self, row_type: type[Any], key: str, ids: list[str]) -> list[Any]:
        cols = ", ".join(columns(row_type))
        order = ", ".join(_KEYS[row_type])
        records = await self.conn.fetch(
            f"SELECT {cols} FROM {self.table(row_type)} WHERE {key} = ANY($1::text[]) "
            f"ORDER BY {order} FOR UPDATE",
            ids,
        )
        return [row_type(*record) for record in records]

    async def write(self, changes: Changes) -> None:
        for rows in (
            changes.rollouts,
            changes.attempts,
            changes.resources,
            changes.workers,
            changes.rewards,
            changes.agl_records,
        ):
            if rows:
                await self._upsert(rows)
        if changes.spans:
            await self.insert_spans(changes.spans)

    async def _upsert(self, rows: Sequence[Row]) -> None:
        sql = self._upserts[type(rows[0])]
        records = [values(r) for r in rows]
        try:
            async with self.conn.transaction():  # a savepoint
                await self.conn.executemany(sql, records)
        except (
            asyncpg.CharacterNotInRepertoireError,
            asyncpg.UntranslatableCharacterError,
            UnicodeEncodeError,
        ):
            # A NUL or a lone surrogate in text (jsonb's codec replaces its own): stored as
            # pg_text says.
            await self.conn.executemany(sql, [tuple(map(pg_text.column, r)) for r in records])

    async def insert_spans(self, spans: Sequence[SpanRow | bytes]) -> None:
        """One binary COPY when none is there yet (the usual case); otherwise the rows go
        through a temporary table and are inserted in order, keeping the row recorded first."""
        data = copy_data(spans)
        try:
            async with self.conn.transaction():  # a savepoint
                await self._copy("spans", data, self.schema)
        except asyncpg.UniqueViolationError:
            async with self.conn.transaction():  # the table's rows live until its commit
                await self.conn.execute(
                    "CREATE TEMPORARY TABLE IF NOT EXISTS spans_in "
                    f"(LIKE {self.table(SpanRow)}, ordinal bigserial) ON COMMIT DELETE ROWS"
                )
                await self._copy("spans_in", data, None)
                cols = ", ".join(columns(SpanRow))
                await self.conn.execute(
                    f"INSERT INTO {self.table(SpanRow)} ({cols}) SELECT {cols} FROM spans_in "
                    "ORDER BY ordinal ON CONFLICT DO NOTHING; TRUNCATE spans_in"
                )

    async def _copy(self, table: str, data: bytes, schema: str | None) -> None:
        await self.conn.copy_to_table(  # a memoryview: asyncpg reads bytes as a file's path
            table,
            source=memoryview(data),
            columns=COPY_COLUMNS,
            schema_name=schema,
            format="binary",
        )

    # ---- offsets -------------------------------------------------------------------------

    async def lock_offsets(self, partitions: Iterable[Partition]) -> dict[Partition, int]:
        """Stored next offsets of the partitions, locked until the transaction ends."""
        wanted = sorted(set(partitions))
        records = await self.conn.fetch(
            f"SELECT topic, partition, next_offset FROM {self.table('projector_offsets')} "
            "WHERE (topic, partition) IN (SELECT * FROM unnest($1::text[], $2::int[])) "
            "ORDER BY topic, partition FOR UPDATE",
            [t for t, _ in wanted],
            [p for _, p in wanted],
        )
        return {(r["topic"], r["partition"]): r["next_offset"] for r in records}

    async def offsets(self) -> dict[Partition, int]:
        records = await self.conn.fetch(
            f"SELECT topic, partition, next_offset FROM {self.table('projector_offsets')}"
        )
        return {(r["topic"], r["partition"]): r["next_offset"] for r in records}

    async def save_offsets(
        self, next_offsets: Mapping[Partition, int], end_offsets: Mapping[Partition, int]
    ) -> None:
        await self.conn.executemany(
            f"INSERT INTO {self.table('projector_offsets')} "
            "(topic, partition, next_offset, end_offset, updated_at) "
            "VALUES ($1, $2, $3, $4, now()) ON CONFLICT (topic, partition) DO UPDATE SET "
            "next_offset = EXCLUDED.next_offset, end_offset = EXCLUDED.end_offset, "
            "updated_at = EXCLUDED.updated_at",
            [
                (t, p, offset, max(offset, end_offsets.get((t, p), offset)))
                for (t, p), offset in sorted(next_offsets.items())
            ],
        )
        # Delivered at commit: waiters for offsets or rollouts look again.
        await self.conn.execute("SELECT pg_notify($1, $2)", NOTIFY_CHANNEL, self.schema)

    # ---- SQL -----------------------------------------------------------------------------

    def _insert_sql(self, row_type: type[Row]) -> str:
        cols = columns(row_type)
        params = ", ".join(f"${i}" for i in range(1, len(cols) + 1))
        return (
            f"INSERT INTO {self.table(row_type)} ({', '.join(cols)}) VALUES ({params}) "
            f"ON CONFLICT ({', '.join(_KEYS[row_type])}) DO NOTHING"
        )

    def _upsert_sql(self, row_type: type[Row]) -> str:
        keys = _KEYS[row_type]
        updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in columns(row_type) if c not in keys)
        insert = self._insert_sql(row_type).removesuffix("DO NOTHING")
        return f"{insert}DO UPDATE SET {updates}"


async def active_read_model(conn: asyncpg.Connection, lock: bool = False) -> str:
    """The schema queries read and live projectors write. `lock` holds it (FOR SHARE) so a
    replay cannot switch it under a running transaction."""
    for _ in range(3):
        name = await conn.fetchval(
            "SELECT name FROM public.read_models WHERE active" + (" FOR SHARE" if lock else "")
        )
        if name is not None:
            return str(name)
    raise LookupError("no active read model: run `agl-stream db upgrade`")
