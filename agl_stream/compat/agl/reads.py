"""The store facade's reads over the read model: its records (agl_records) and the spans table,
with Agent Lightning's filters (exact, within, contains; AND or OR), sorting and pagination.

Sorting follows Agent Lightning's collections: a missing *_time sorts last, a missing text as
"", a missing number as 0; text compares by code point (COLLATE "C", as Python does); ties
keep insertion order.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import asyncpg
from pydantic import BaseModel

from agl_stream.db.outage import DatabaseUnavailable, reason, unavailable

Logic = Literal["and", "or"]


@dataclass
class Sql:
    """A WHERE clause being built, with its parameters."""

    params: list[Any] = field(default_factory=list)

    def param(self, value: Any, cast: str = "") -> str:
        self.params.append(value)
        return f"${len(self.params)}{cast}"


@dataclass(frozen=True)
class Match:
    """Agent Lightning's operators on one field: exact, within, contains."""

    column: str  # an SQL expression of the field as text
    exact: Any = None
    within: Sequence[Any] | None = None
    contains: str | None = None

    def conditions(self, sql: Sql) -> list[str]:
        out = []
        if self.exact is not None:
            out.append(f"{self.column} = {sql.param(str(self.exact))}")
        if self.within is not None:
            values = [str(v) for v in self.within]
            out.append(
                f"{self.column} = ANY({sql.param(values, '::text[]')})" if values else "false"
            )
        if self.contains is not None:
            out.append(f"strpos({self.column}, {sql.param(self.contains)}) > 0")
        return out


def where(sql: Sql, must: Sequence[str], matches: Sequence[Match], logic: Logic) -> str:
    """`must` always holds; the matches' conditions pool together with AND or OR."""
    pooled = [c for m in matches for c in m.conditions(sql)]
    parts = list(must)
    if pooled:
        parts.append("(" + f" {logic.upper()} ".join(pooled) + ")")
    return " AND ".join(parts) if parts else "true"


def record_field(name: str) -> str:
    return f"(body->'record'->>'{name}')"


def sort_expression(model: type[BaseModel], name: str, column: str) -> str:
    """How to order by `name` (a field of `model`), with Agent Lightning's defaults for None."""
    if name not in model.model_fields:
        raise ValueError(
            f"cannot sort by {name!r}: {model.__name__} has the fields "
            + ", ".join(model.model_fields)
        )
    kind = _field_kind(model, name)
    if name.endswith("_time") or kind == "number":
        number = f"({column})::double precision"
        default = "'Infinity'::double precision" if name.endswith("_time") else "0"
        return f"COALESCE({number}, {default})"
    if kind == "text":
        return f"COALESCE({column}, '') COLLATE \"C\""
    raise ValueError(f"cannot sort by {name!r}: it is neither text nor a number")


def sort_key(model: type[BaseModel], name: str) -> Callable[[BaseModel], Any]:
    """The order of `sort_expression` in Python, for records the store holds in memory."""
    sort_expression(model, name, name)  # refuses what does not sort, as the read model does
    if name.endswith("_time") or _field_kind(model, name) == "number":
        default = float("inf") if name.endswith("_time") else 0.0

        def number(item: BaseModel) -> float:
            value = getattr(item, name)
            return default if value is None else float(value)

        return number

    def text(item: BaseModel) -> str:
        value = getattr(item, name)
        return "" if value is None else str(value)

    return text


def _field_kind(model: type[BaseModel], name: str) -> str:
    annotation = model.model_fields[name].annotation
    unions = (typing.Union, types.UnionType)
    options = typing.get_args(annotation) if typing.get_origin(annotation) in unions else ()
    first = next((o for o in options if o is not type(None)), annotation)
    if typing.get_origin(first) is Literal or first is str:
        return "text"
    if first in (int, float):
        return "number"
    return "other"


def page(limit: int, offset: int) -> str:
    """LIMIT/OFFSET as Agent Lightning pages: -1 is no limit."""
    if offset < 0:
        raise ValueError(f"offset must be 0 or more, got {offset}")
    if limit < -1:
        raise ValueError(f"limit must be -1 (no limit) or 0 or more, got {limit}")
    return ("" if limit == -1 else f" LIMIT {int(limit)}") + f" OFFSET {int(offset)}"


def epoch(at: datetime) -> float:
    return at.astimezone(UTC).timestamp()


@dataclass(frozen=True)
class Stored:
    """One row of agl_records."""

    kind: str
    rollout_id: str
    record_id: str
    revision: int
    created_at: float
    body: dict[str, Any]

    @staticmethod
    def of(row: Mapping[str, Any]) -> Stored:
        return Stored(
            row["kind"],
            row["rollout_id"],
            row["record_id"],
            row["revision"],
            epoch(row["created_at"]),
            row["body"],
        )


RECORD_COLUMNS = "kind, rollout_id, record_id, revision, created_at, body"


class Reads:
    """Queries over one read model schema through a pool of connections."""

    def __init__(self, pool: asyncpg.Pool, schema: str) -> None:
        self.pool = pool
        self.schema = schema

    def table(self, name: str) -> str:
        return f'"{self.schema}".{name}'

    async def fetch(self, query: str, *params: Any) -> list[asyncpg.Record]:
        for param in params:
            for text in param if isinstance(param, list) else [param]:
                if isinstance(text, str) and "\x00" in text:
                    # (ids are checked before this; a name filter, say, is not an id)
                    raise ValueError(
                        "text with a NUL character (U+0000) cannot be looked for: the read "
                        "model holds none"
                    )
        try:
            async with self.pool.acquire() as conn:
                return list(await conn.fetch(query, *params))
        except Exception as exc:
            if unavailable(exc):  # the caller may try again (HTTP 503)
                raise DatabaseUnavailable(
                    f"the store's read model is out of reach: {reason(exc)}"
                ) from exc
            raise

    async def record(self, kind: str, record_id: str, rollout_id: str = "") -> Stored | None:
        rows = await self.fetch(
            f"SELECT {RECORD_COLUMNS} FROM {self.table('agl_records')} "
            "WHERE kind = $1 AND rollout_id = $2 AND record_id = $3",
            kind,
            rollout_id,
            record_id,
        )
        return Stored.of(rows[0]) if rows else None

    async def records(
        self,
        kind: str,
        model: type[BaseModel],
        *,
        must: Sequence[str] = (),
        must_params: Sequence[Any] = (),
        matches: Sequence[Match] = (),
        logic: Logic = "and",
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> tuple[list[Stored], int]:
        """One page of records and how many match in all."""
        sql = Sql()
        clauses = [f"kind = {sql.param(kind)}"]
        for clause, value in zip(must, must_params, strict=True):
            clauses.append(clause.format(sql.param(value)))
        condition = where(sql, clauses, matches, logic)
        order = ""
        if sort_by is not None:
            direction = "DESC" if sort_order == "desc" else "ASC"
            order = f"{sort_expression(model, sort_by, record_field(sort_by))} {direction}, "
        order += "created_at, rollout_id, record_id"
        table = self.table("agl_records")
        rows = await self.fetch(
            f"SELECT {RECORD_COLUMNS} FROM {table} WHERE {condition} ORDER BY {order}"
            + page(limit, offset),
            *sql.params,
        )
        total = await self.fetch(
            f"SELECT count(*) AS n FROM {table} WHERE {condition}", *sql.params
        )
        return [Stored.of(r) for r in rows], int(total[0]["n"])

    async def live_rollout_ids(self) -> list[str]:
        """The rollouts that are queued or running: the store's live state."""
        rows = await self.fetch(
            f"SELECT record_id FROM {self.table('agl_records')} WHERE kind = 'rollout' AND "
            f"{record_field('status')} IN ('queuing', 'requeuing', 'preparing', 'running')"
        )
        return [r["record_id"] for r in rows]

    async def rollouts_with_attempts(self, rollout_ids: Sequence[str]) -> list[Stored]:
        """These rollouts' records and their attempts' (in no order)."""
        rows = await self.fetch(
            f"SELECT {RECORD_COLUMNS} FROM {self.table('agl_records')} "
            "WHERE kind IN ('rollout', 'attempt') AND rollout_id = ANY($1::text[])",
            list(rollout_ids),
        )
        return [Stored.of(r) for r in rows]

    async def latest_attempts(self, rollout_ids: Sequence[str]) -> dict[str, Stored]:
        """Each rollout's attempt with the highest sequence id."""
        if not rollout_ids:
            return {}
        rows = await self.fetch(
            f"SELECT DISTINCT ON (rollout_id) {RECORD_COLUMNS} FROM {self.table('agl_records')} "
            "WHERE kind = 'attempt' AND rollout_id = ANY($1::text[]) "
            f"ORDER BY rollout_id, {record_field('sequence_id')}::bigint DESC",
            list(rollout_ids),
        )
        return {r["rollout_id"]: Stored.of(r) for r in rows}

    async def latest_resources(self) -> Stored | None:
        rows = await self.fetch(
            f"SELECT {RECORD_COLUMNS} FROM {self.table('agl_records')} WHERE kind = 'resources' "
            f"ORDER BY {record_field('update_time')}::double precision DESC, created_at "
            "LIMIT 1"
        )
        return Stored.of(rows[0]) if rows else None

    async def counts(self) -> dict[str, int]:
        rows = await self.fetch(
            f"SELECT kind, count(*) AS n FROM {self.table('agl_records')} GROUP BY kind"
        )
        counts = {r["kind"]: int(r["n"]) for r in rows}
        spans = await self.fetch(
            f"SELECT count(*) AS n FROM {self.table('spans')} s WHERE EXISTS (SELECT 1 FROM "
            f"{self.table('agl_records')} r WHERE r.kind = 'rollout' AND r.rollout_id = "
            "s.rollout_id AND r.record_id = s.rollout_id)"
        )
        counts["span"] = int(spans[0]["n"])
        return counts

    # ---- spans -------------------------------------------------------------------------

    async def attempt_span_keys(
        self, rollout_id: str, attempt_id: str
    ) -> tuple[set[str], set[int]]:
        """The span ids and sequence ids of one attempt's spans."""
        rows = await self.fetch(
            f"SELECT span_id, sequence FROM {self.table('spans')} WHERE rollout_id = $1 AND "
            "attempt_id = $2",
            rollout_id,
            attempt_id,
        )
        return {r["span_id"] for r in rows}, {r["sequence"] for r in rows}

    async def max_span_sequence(self, rollout_id: str) -> int:
        rows = await self.fetch(
            f"SELECT max(sequence) AS m FROM {self.table('spans')} WHERE rollout_id = $1",
            rollout_id,
        )
        return int(rows[0]["m"] or 0)

    async def spans(
        self,
        rollout_id: str,
        attempt_id: str | None,
        matches: Sequence[Match],
        logic: Logic,
        sort: str | None,
        sort_order: Literal["asc", "desc"],
        limit: int,
        offset: int,
    ) -> tuple[list[asyncpg.Record], int]:
        sql = Sql()
        must = [f"rollout_id = {sql.param(rollout_id)}"]
        if attempt_id is not None:
            must.append(f"attempt_id = {sql.param(attempt_id)}")
        condition = where(sql, must, matches, logic)
        order = ""
        if sort is not None:
            order = f"{sort} {'DESC' if sort_order == 'desc' else 'ASC'}, "
        order += "recorded_at, attempt_id, sequence"
        table = self.table("spans")
        rows = await self.fetch(
            f"SELECT * FROM {table} WHERE {condition} ORDER BY {order}" + page(limit, offset),
            *sql.params,
        )
        total = await self.fetch(
            f"SELECT count(*) AS n FROM {table} WHERE {condition}", *sql.params
        )
        return rows, int(total[0]["n"])


# Agent Lightning's span fields that sort, as the spans table's columns.
SPAN_SORTS = {
    "rollout_id": 'rollout_id COLLATE "C"',
    "attempt_id": 'attempt_id COLLATE "C"',
    "sequence_id": "sequence",
    "trace_id": 'trace_id COLLATE "C"',
    "span_id": 'span_id COLLATE "C"',
    "parent_id": "COALESCE(parent_span_id, '') COLLATE \"C\"",
    "name": 'name COLLATE "C"',
    "start_time": "(CASE WHEN start_time_unix_nano = 0 THEN 'Infinity'::double precision "
    "ELSE start_time_unix_nano::double precision END)",
    "end_time": "(CASE WHEN end_time_unix_nano = 0 THEN 'Infinity'::double precision "
    "ELSE end_time_unix_nano::double precision END)",
}
SPAN_COLUMNS = {
    "trace_id": "trace_id",
    "span_id": "span_id",
    "parent_id": "parent_span_id",
    "name": "name",
}
