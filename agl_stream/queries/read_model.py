"""The async query API over the read model (SQLAlchemy Core on asyncpg)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from datetime import UTC, datetime
from typing import Any

import asyncpg
from aiokafka import TopicPartition
from sqlalchemy import (
    ColumnElement,
    Select,
    Text,
    and_,
    cast,
    func,
    literal,
    or_,
    select,
    text,
    tuple_,
)
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from agl_stream.db import schema as db
from agl_stream.db.engine import async_engine
from agl_stream.events import PIN_ONLY
from agl_stream.projection.store import NOTIFY_CHANNEL
from agl_stream.queries.models import (
    Attempt,
    Page,
    PartitionLag,
    Resources,
    Reward,
    Rollout,
    Span,
    Worker,
)
from agl_stream.queries.params import (
    NotFound,
    QueryError,
    RolloutFilter,
    check_limit,
    check_range,
    check_text,
    decode_cursor,
    encode_cursor,
)
from agl_stream.runtime.config import DatabaseSettings

Offsets = Mapping[TopicPartition, int] | Mapping[tuple[str, int], int]
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
_RECHECK_SECONDS = 5.0  # waiting re-reads at least this often even without a notification
_IDS_PER_QUERY = 1000  # bind parameters per IN list (asyncpg takes at most 32,767)

_R = db.rollouts.c
_SORT_COLUMNS: dict[str, ColumnElement[Any]] = {
    "queued": func.coalesce(_R.first_queued_at, _R.updated_at),
    "updated": _R.updated_at,
    "id": _R.rollout_id,
}
_TIME_COLUMNS: dict[str, ColumnElement[Any]] = {
    "queued": _R.first_queued_at,
    "updated": _R.updated_at,
    "finished": _R.finished_at,
}


class ReadModel:
    """Queries over one read model: the active one unless named."""

    def __init__(self, database: DatabaseSettings, engine: AsyncEngine, schema: str) -> None:
        self.database = database
        self.schema = schema
        self._engine = engine

    @classmethod
    @asynccontextmanager
    async def open(
        cls, database: DatabaseSettings, read_model: str | None = None
    ) -> AsyncIterator[ReadModel]:
        # pre-ping: a pooled connection PostgreSQL dropped (a restart) is replaced, not used.
        engine = async_engine(database, pool_size=2, max_overflow=4, pool_pre_ping=True)
        try:
            async with engine.connect() as conn:
                schema = await _resolve(conn, read_model)
            yield cls(database, engine, schema)
        finally:
            await engine.dispose()

    @asynccontextmanager
    async def _connect(self) -> AsyncIterator[AsyncConnection]:
        async with self._engine.connect() as conn:
            yield await conn.execution_options(schema_translate_map={None: self.schema})

    async def _all(self, statement: Any) -> list[Any]:
        async with self._connect() as conn:
            return list((await conn.execute(statement)).mappings().all())

    # ---- rollouts and attempts -----------------------------------------------------------

    async def rollouts(
        self, filter: RolloutFilter | None = None, wait_for: Offsets | None = None, **options: Any
    ) -> Page[Rollout]:
        """One page of rollouts; pass options (status=("failed",), since=...) or a filter."""
        f = filter if filter is not None else RolloutFilter.of(**options)
        if wait_for:
            await self.wait_for_offsets(wait_for)
        rows = await self._all(rollouts_statement(f))
        more = len(rows) > f.limit
        rows = rows[: f.limit]
        cursor = None
        if more and rows:
            cursor = encode_cursor(f.sort, f.descending, rows[-1]["_sort"], rows[-1]["rollout_id"])
        return Page[Rollout](items=[_rollout(r) for r in rows], next_cursor=cursor)

    async def status_counts(self) -> dict[str, int]:
        """How many rollouts are in each status."""
        rows = await self._all(select(_R.status, func.count().label("count")).group_by(_R.status))
        return {row["status"]: row["count"] for row in rows}

    async def rollout(self, rollout_id: str, wait_for: Offsets | None = None) -> Rollout:
        check_text(rollout_id=rollout_id)
        if wait_for:
            await self.wait_for_offsets(wait_for)
        rows = await self._all(select(*_rollout_columns()).where(_R.rollout_id == rollout_id))
        if not rows:
            raise NotFound(f"no rollout {rollout_id!r} in the read model")
        return _rollout(rows[0])

    async def rollouts_by_id(self, rollout_ids: Iterable[str]) -> dict[str, Rollout]:
        """The rollouts the read model holds among these ids; an id it lacks is left out."""
        ids = sorted(set(rollout_ids))
        for rollout_id in ids:
            check_text(rollout_id=rollout_id)
        found: dict[str, Rollout] = {}
        for start in range(0, len(ids), _IDS_PER_QUERY):
            chunk = ids[start : start + _IDS_PER_QUERY]
            rows = await self._all(select(*_rollout_columns()).where(_R.rollout_id.in_(chunk)))
            found.update((row["rollout_id"], _rollout(row)) for row in rows)
        return found

    async def attempts(self, rollout_id: str, wait_for: Offsets | None = None) -> list[Attempt]:
        """The rollout's attempts, oldest first."""
        await self.rollout(rollout_id, wait_for)
        a, s = db.attempts.c, db.spans.c
        received = (
            select(func.count())
            .where(s.rollout_id == a.rollout_id, s.attempt_id == a.attempt_id)
            .scalar_subquery()
        )
        query = (
            select(
                a.rollout_id,
                a.attempt_id,
                a.attempt_number,
                a.status,
                a.worker_id,
                a.resources_id,
                a.started_at,
                a.finished_at,
                a.error,
                a.span_count,
                received.label("spans_received"),
                a.reward,
            )
            .where(a.rollout_id == rollout_id)
            .order_by(a.attempt_number, func.coalesce(a.started_at, a.finished_at), a.attempt_id)
        )
        return [Attempt.model_validate(dict(r)) for r in await self._all(query)]

    # ---- spans ---------------------------------------------------------------------------

    async def spans(
        self,
        rollout_id: str,
        *,
        attempt_id: str | None = None,
        latest_attempt: bool = False,
        name: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int = 10_000,
        wait_for: Offsets | None = None,
    ) -> list[Span]:
        """Spans of a rollout (every attempt, or one, or the latest), in attempt and
        sequence order; `name` and the time range (span start) filter them. Spans need no
        rollout row: those of calls a gateway saw with no attempt are under `unattributed`."""
        check_limit(limit, 100_000)
        check_text(rollout_id=rollout_id, attempt_id=attempt_id, name=name)
        since, until = check_range(since, until)
        if attempt_id is not None and latest_attempt:
            raise QueryError("ask for one attempt or for the latest attempt, not both")
        if wait_for:
            await self.wait_for_offsets(wait_for)
        if latest_attempt:
            attempt_id = (await self.rollout(rollout_id)).latest_attempt_id
            if attempt_id is None:
                return []
        s = db.spans.c
        query = select(*(getattr(s, f) for f in Span.model_fields)).where(
            s.rollout_id == rollout_id
        )
        if attempt_id is not None:
            query = query.where(s.attempt_id == attempt_id)
        if name is not None:
            query = query.where(s.name == name)
        if since is not None:
            query = query.where(s.start_time >= since)
        if until is not None:
            query = query.where(s.start_time < until)
        query = query.order_by(s.attempt_id, s.sequence).limit(limit)
        found = [Span.model_validate(dict(r)) for r in await self._all(query)]
        if not found:
            await self.rollout(rollout_id)  # NotFound: no such rollout at all
        return found

    # ---- rewards given from outside an attempt ---------------------------------------------

    async def rewards(
        self,
        rollout_id: str | None = None,
        *,
        attempt_id: str | None = None,
        name: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int = 1000,
        wait_for: Offsets | None = None,
    ) -> list[Reward]:
        """Rewards recorded with RewardRecorded that counted (those for an unknown rollout or
        attempt are in the dead-letter topic), newest given first; of one rollout (NotFound
        when the read model has no such rollout) or of all, by name and time given."""
        check_limit(limit, 100_000)
        check_text(rollout_id=rollout_id, attempt_id=attempt_id, name=name)
        since, until = check_range(since, until)
        if wait_for:
            await self.wait_for_offsets(wait_for)
        if rollout_id is not None:
            await self.rollout(rollout_id)
        w = db.rewards.c
        query = select(
            w.rollout_id, w.attempt_id, w.span_id, w.name, w.value, w.source, w.metadata,
            w.given_at, cast(w.event_id, Text).label("event_id"),
        )  # fmt: skip
        for column, value in ((w.rollout_id, rollout_id), (w.attempt_id, attempt_id)):
            if value is not None:
                query = query.where(column == value)
        if name is not None:
            query = query.where(w.name == name)
        if since is not None:
            query = query.where(w.given_at >= since)
        if until is not None:
            query = query.where(w.given_at < until)
        query = query.order_by(w.given_at.desc(), w.event_id).limit(limit)
        return [Reward.model_validate(dict(r)) for r in await self._all(query)]

    # ---- resources and workers -----------------------------------------------------------

    async def resources_history(
        self,
        *,
        name: str | None = None,
        limit: int = 100,
        include_pin_only: bool = True,
        policy: str | None = None,
    ) -> list[Resources]:
        """Resources versions, newest first; `name` keeps those holding that resource;
        `include_pin_only=False` leaves out versions only pinned tasks run with (candidates);
        `policy` keeps those that policy's trainer published (its lineage)."""
        check_limit(limit)
        check_text(name=name, policy=policy)
        r = db.resources.c
        query = select(*(getattr(r, f) for f in Resources.model_fields))
        if name is not None:
            query = query.where(r.resources.has_key(name))
        if policy is not None:
            query = query.where(r["metadata"]["policy"].astext == policy)
        if not include_pin_only:
            query = query.where(r["metadata"][PIN_ONLY].astext.is_distinct_from("true"))
        query = query.order_by(r.version.desc(), r.published_at.desc(), r.resources_id)
        return [Resources.model_validate(dict(x)) for x in await self._all(query.limit(limit))]

    async def run_versions(self, limit: int = 20_000) -> list[Resources]:
        """The newest versions that training runs published (GRPO steps: `run_name` in
        their metadata; APO's best prompts: `val_score`), newest first."""
        check_limit(limit, most=100_000)
        r = db.resources.c
        query = select(*(getattr(r, f) for f in Resources.model_fields)).where(
            r["metadata"].has_key("run_name") | r["metadata"].has_key("val_score")
        )
        query = query.order_by(r.published_at.desc(), r.resources_id).limit(limit)
        return [Resources.model_validate(dict(x)) for x in await self._all(query)]

    async def latest_resources(self) -> Resources:
        """The version runners hand out: the highest one that is not pin-only."""
        history = await self.resources_history(limit=1, include_pin_only=False)
        if not history:
            raise NotFound("no resources have been published")
        return history[0]

    async def workers(
        self, *, role: str | None = None, now: datetime | None = None
    ) -> list[Worker]:
        """Workers by last heartbeat; health: alive, stale (silent for 3 intervals), stopped."""
        check_text(role=role)
        w = db.workers.c
        query = select(*(c for c in db.workers.c if c.name != "event_id"))
        if role is not None:
            query = query.where(w.role == role)
        rows = await self._all(query.order_by(w.role, w.worker_id))
        at = now or datetime.now(UTC)
        return [Worker.model_validate({**r, "health": _health(r, at)}) for r in rows]

    # ---- waiting -------------------------------------------------------------------------

    async def wait_for_rollouts(
        self,
        rollout_ids: Iterable[str],
        within: float,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, str]:
        """Wait until every rollout is succeeded, failed or cancelled; their statuses.
        Raises TimeoutError naming those still open. Woken by the projector's commits
        (LISTEN/NOTIFY), so it does not poll. `on_progress(finished, total)` is called each
        time it looks."""
        ids = sorted(set(rollout_ids))
        for rollout_id in ids:
            check_text(rollout_id=rollout_id)
        statuses: dict[str, str] = {}

        async def done() -> bool:
            query = select(_R.rollout_id, _R.status).where(_R.rollout_id.in_(ids))
            statuses.update({r["rollout_id"]: r["status"] for r in await self._all(query)})
            finished = sum(1 for i in ids if statuses.get(i) in TERMINAL)
            if on_progress is not None:
                on_progress(finished, len(ids))
            return finished == len(ids)

        try:
            await self._wait(done, within)
        except TimeoutError:
            open_ = [i for i in ids if statuses.get(i) not in TERMINAL]
            raise TimeoutError(
                f"{len(open_)} of {len(ids)} rollouts not finished after {within:g} s: "
                + ", ".join(open_[:10])
                + (" ..." if len(open_) > 10 else "")
            ) from None
        return {i: statuses[i] for i in ids}

    async def wait_for_offsets(self, offsets: Offsets, within: float = 30.0) -> None:
        """Read-your-writes: wait until the projection has applied the record at each
        (topic, partition) offset (for example, the RecordMetadata of a publish)."""
        wanted = {_partition(tp): offset for tp, offset in offsets.items()}
        o = db.projector_offsets.c

        async def done() -> bool:
            stored = {
                (r["topic"], r["partition"]): r["next_offset"]
                for r in await self._all(select(o.topic, o.partition, o.next_offset))
            }
            return all(stored.get(p, 0) > offset for p, offset in wanted.items())

        try:
            await self._wait(done, within)
        except TimeoutError:
            raise TimeoutError(
                f"the read model did not reach {wanted} within {within:g} s: is a projector "
                "running (`agl-stream worker projector`)?"
            ) from None

    async def _wait(self, done: Callable[[], Awaitable[bool]], within: float) -> None:
        deadline = time.monotonic() + within
        woken = asyncio.Event()
        listener = await asyncpg.connect(self.database.asyncpg_dsn)
        try:
            await listener.add_listener(NOTIFY_CHANNEL, lambda *_: woken.set())
            while not await done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                woken.clear()
                with suppress(TimeoutError):
                    await asyncio.wait_for(woken.wait(), min(left, _RECHECK_SECONDS))
        finally:
            await listener.close()

    # ---- the projection itself -----------------------------------------------------------

    async def lag(
        self, end_offsets: Mapping[tuple[str, int], int] | None = None
    ) -> list[PartitionLag]:
        """Per partition: where the projection stands and how far behind the topic's end
        (the given end offsets, or the end the projector last saw); a partition given an end
        that the projection never stored is behind by all of it."""
        o = db.projector_offsets.c
        rows = await self._all(select(db.projector_offsets).order_by(o.topic, o.partition))
        ends = dict(end_offsets or {})
        out = []
        for r in rows:
            end = max(r["end_offset"], ends.pop((r["topic"], r["partition"]), 0))
            out.append(
                PartitionLag(
                    topic=r["topic"],
                    partition=r["partition"],
                    next_offset=r["next_offset"],
                    end_offset=end,
                    lag=max(0, end - r["next_offset"]),
                    updated_at=r["updated_at"],
                )
            )
        # Partitions the projection never stored an offset for: behind by all they hold.
        for (topic, partition), end in ends.items():
            out.append(PartitionLag(
                topic=topic, partition=partition, next_offset=0, end_offset=end, lag=end,
                updated_at=None,
            ))  # fmt: skip
        return sorted(out, key=lambda p: (p.topic, p.partition))


async def _resolve(conn: AsyncConnection, read_model: str | None) -> str:
    if read_model is None:
        name = (await conn.execute(text("SELECT name FROM read_models WHERE active"))).scalar()
        if name is None:
            raise QueryError("no active read model: run `agl-stream db upgrade`")
        return str(name)
    check_text(read_model=read_model)
    found = (
        await conn.execute(text("SELECT state FROM read_models WHERE name = :n"), {"n": read_model})
    ).scalar()
    if found is None:
        raise NotFound(f"no read model named {read_model!r} (see `agl-stream query read-models`)")
    return read_model


def _partition(tp: TopicPartition | tuple[str, int]) -> tuple[str, int]:
    return (tp.topic, tp.partition) if isinstance(tp, TopicPartition) else (tp[0], tp[1])


def _rollout_columns() -> Sequence[ColumnElement[Any]]:
    return [getattr(_R, f) for f in Rollout.model_fields]


def _rollout(row: Mapping[str, Any]) -> Rollout:
    return Rollout.model_validate({k: row[k] for k in Rollout.model_fields})


def _conditions(f: RolloutFilter) -> list[ColumnElement[bool]]:
    out: list[ColumnElement[bool]] = []
    if f.status:
        out.append(_R.status.in_(f.status))
    if f.mode:
        out.append(_R.mode.in_(f.mode))
    column = _TIME_COLUMNS[f.time_field]
    if f.since is not None:
        out.append(column >= f.since)
    if f.until is not None:
        out.append(column < f.until)
    if f.worker_id is not None:
        out.append(_R.worker_id == f.worker_id)
    if f.resources_id is not None:
        out.append(
            or_(_R.resources_id == f.resources_id, _R.attempt_resources_id == f.resources_id)
        )
    for key, value in f.metadata.items():
        if value is None:
            out.append(_R.metadata.has_key(key))
        else:
            out.append(_R.metadata.contains({key: value}))
    return [and_(*out)] if out else []


def _health(row: Mapping[str, Any], now: datetime) -> str:
    if row["status"] == "stopped":
        return "stopped"
    silent = (now - row["last_heartbeat_at"]).total_seconds()
    return "alive" if silent <= 3 * row["interval_seconds"] else "stale"


def rollouts_statement(f: RolloutFilter) -> Select[Any]:
    """The SELECT of one page of rollouts (one row more than the page, to know there is a
    next); migration rm0004's indexes follow its default order."""
    query = select(*_rollout_columns())
    for condition in _conditions(f):
        query = query.where(condition)
    order = _SORT_COLUMNS[f.sort]
    if f.cursor is not None:
        value, last_id = decode_cursor(f.cursor, f.sort, f.descending)
        if f.sort == "id":
            query = query.where(
                _R.rollout_id < last_id if f.descending else _R.rollout_id > last_id
            )
        else:
            key, at = tuple_(order, _R.rollout_id), tuple_(literal(value), literal(last_id))
            query = query.where(key < at if f.descending else key > at)
    if f.descending:
        query = query.order_by(order.desc(), _R.rollout_id.desc())
    else:
        query = query.order_by(order.asc(), _R.rollout_id.asc())
    query = query.limit(f.limit + 1)
    return query.add_columns(order.label("_sort"))
