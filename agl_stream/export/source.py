"""Attempts with their LLM calls, streamed out of the read model through one server-side
cursor: the client holds one attempt's calls at a time, however large the export."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from agl_stream.agent.llm import DEFAULT_POLICY, LLM_CALL_SPAN, POLICY
from agl_stream.db.migrate import check_schema_name
from agl_stream.export.records import AttemptCalls
from agl_stream.projection.store import active_read_model, connect


class ExportError(ValueError):
    """An export that cannot run as asked; the message names the setting."""


@dataclass(frozen=True)
class ExportFilter:
    attempt_status: Sequence[str] = ("succeeded",)
    modes: Sequence[str] = ()
    metadata: dict[str, str] | None = None
    since: datetime | None = None  # attempts that finished from then on
    until: datetime | None = None  # ... and before then
    reward_name: str | None = None  # a late reward's name; None: the attempt's final reward
    min_reward: float | None = None
    by_group: bool = False  # ordered by task group (for preference pairs)
    policy: str | None = None  # only the calls of this policy (agl.llm.policy)

    def __post_init__(self) -> None:
        if self.since and self.until and self.since >= self.until:
            raise ExportError("--since must be before --until")


# A named reward of an attempt: its own (latest given) before one given to its rollout.
_NAMED_REWARD = """(SELECT w.value FROM {schema}.rewards w
    WHERE w.rollout_id = a.rollout_id AND w.name = {name}
      AND (w.attempt_id = a.attempt_id OR w.attempt_id IS NULL)
    ORDER BY w.attempt_id IS NULL, w.given_at DESC, w.event_id LIMIT 1)"""


def query(schema: str, f: ExportFilter) -> tuple[str, list[Any]]:
    q = f'"{check_schema_name(schema)}"'
    args: list[Any] = []
    where = ["a.finished_at IS NOT NULL"]

    def arg(value: Any) -> str:
        args.append(value)
        return f"${len(args)}"

    if f.attempt_status:
        where.append(f"a.status = ANY({arg(list(f.attempt_status))}::text[])")
    if f.modes:
        where.append(f"r.mode = ANY({arg(list(f.modes))}::text[])")
    if f.metadata:
        where.append(f"r.metadata @> {arg(dict(f.metadata))}::jsonb")  # the jsonb codec encodes it
    if f.since is not None:
        where.append(f"a.finished_at >= {arg(f.since)}")
    if f.until is not None:
        where.append(f"a.finished_at < {arg(f.until)}")
    reward = (
        _NAMED_REWARD.format(schema=q, name=arg(f.reward_name)) if f.reward_name else "a.reward"
    )
    minimum = "" if f.min_reward is None else f"WHERE c.reward >= {arg(f.min_reward)}"
    policy = (
        ""
        if f.policy is None
        else f"AND coalesce(s.attributes->>'{POLICY}', '{DEFAULT_POLICY}') = {arg(f.policy)}"
    )
    group = "coalesce(c.metadata->>'group', c.input::text), " if f.by_group else ""
    sql = f"""
        WITH chosen AS MATERIALIZED (
            SELECT a.rollout_id, a.attempt_id, r.mode, r.input, r.metadata, a.finished_at,
                   {reward} AS reward
            FROM {q}.attempts a JOIN {q}.rollouts r ON r.rollout_id = a.rollout_id
            WHERE {" AND ".join(where)}
        )
        SELECT c.rollout_id, c.attempt_id, c.mode, c.input, c.metadata, c.finished_at, c.reward,
               s.attributes
        FROM chosen c JOIN {q}.spans s
          ON s.rollout_id = c.rollout_id AND s.attempt_id = c.attempt_id
         AND s.name = '{LLM_CALL_SPAN}' AND s.status_code <> 'ERROR' {policy}
        {minimum}
        ORDER BY {group}c.rollout_id, c.attempt_id, s.end_time_unix_nano, s.sequence
    """
    return sql, args


async def attempts(
    dsn: str, f: ExportFilter, read_model: str | None = None, prefetch: int = 2000
) -> AsyncIterator[AttemptCalls]:
    """Each matching attempt with its calls, in order (by group first when asked)."""
    conn = await connect(dsn)
    try:
        schema = read_model or await active_read_model(conn)
        sql, args = query(schema, f)
        async with conn.transaction(readonly=True, isolation="repeatable_read"):
            current: AttemptCalls | None = None
            calls: list[Any] = []
            async for row in conn.cursor(sql, *args, prefetch=prefetch):
                key = (row["rollout_id"], row["attempt_id"])
                if current is not None and key != (current.rollout_id, current.attempt_id):
                    yield _with(current, calls)
                    calls = []
                if not calls:
                    current = AttemptCalls(
                        row["rollout_id"], row["attempt_id"], row["mode"], row["input"],
                        row["metadata"] or {}, row["finished_at"], row["reward"], (),
                    )  # fmt: skip
                calls.append(row["attributes"])
            if current is not None and calls:
                yield _with(current, calls)
    except asyncpg.UndefinedTableError as exc:
        raise ExportError(
            f"the read model has no such table ({exc}): run `agl-stream db upgrade`"
        ) from None
    finally:
        await conn.close()


def _with(attempt: AttemptCalls, calls: list[Any]) -> AttemptCalls:
    return AttemptCalls(
        attempt.rollout_id, attempt.attempt_id, attempt.mode, attempt.input, attempt.metadata,
        attempt.finished_at, attempt.reward, tuple(calls),
    )  # fmt: skip
