"""Cancelling rollouts without a broker or a database: what `agl-stream cancel` refuses,
which rollouts it picks (over a fake read model), and what `cancel()` puts on the topic."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import pytest
from click.testing import CliRunner, Result

from agl_stream.bus.codec import Codec
from agl_stream.cli.main import cli
from agl_stream.commands import cancel as cancel_module
from agl_stream.commands.cancel import OPEN_STATUSES, CancelError, cancel, select_by_filter
from agl_stream.embedded.process import pick_port
from agl_stream.events import RolloutCancelled
from agl_stream.queries import Page, ReadModel, Rollout, RolloutFilter
from agl_stream.queries.params import decode_cursor, encode_cursor
from agl_stream.runtime.config import KafkaSettings

NOBODY = {
    "AGL_STREAM_BOOTSTRAP_SERVERS": f"127.0.0.1:{pick_port(40_000, 50_000)}",
    "AGL_STREAM_DATABASE_URL": f"postgresql://agl@127.0.0.1:{pick_port(50_000, 60_000)}/x",
    "AGL_STREAM_REQUEST_TIMEOUT_MS": "1000",
}


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, ["cancel", *args], env=NOBODY)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "say which rollouts to cancel: give rollout ids, or a filter"),
        (("--reason", "why", "--dry-run"), "say which rollouts to cancel"),
        (("--time-field", "updated"), "say which rollouts to cancel"),
        (("ro-1", "--status", "running"), "give rollout ids or a filter, not both"),
        (("ro-1", "--metadata", "batch=7"), "give rollout ids or a filter, not both"),
        (("--force", "--mode", "train"), "--force goes with rollout ids"),
        (("--status", "succeeded"), "'succeeded' is not one of 'queuing', 'requeuing'"),
        (("--metadata", "=7"), "'=7': give KEY=VALUE or KEY"),
        (("--since", "last week"), "is not a time"),
        (("--force", ""), "invalid cancellation: rollout_id"),
    ],
)
def test_refusals_are_usage_errors_that_say_why(args: tuple[str, ...], message: str) -> None:
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output


def test_forced_dry_run_lists_the_ids_and_touches_nothing() -> None:
    # Nothing listens at NOBODY's addresses: looking up or sending would exit 1.
    result = invoke("--force", "--dry-run", "ro-a", "ro-b", "ro-a")
    assert result.exit_code == 0, result.output
    assert "would cancel (2)" in result.output
    assert result.output.count("ro-a") == 1 and "not looked up" in result.output
    result = invoke("--force", "--dry-run", "--print-ids", "ro-a", "ro-b")
    assert result.exit_code == 0 and result.stdout == "ro-a\nro-b\n", result.output


def test_an_unreachable_database_is_a_sentence_that_offers_force() -> None:
    result = invoke("ro-a")
    assert result.exit_code == 1, result.output
    said = " ".join(result.output.split())
    assert "AGL_STREAM_DATABASE_URL (postgresql://agl@127.0.0.1:" in said
    assert "cannot reach PostgreSQL" in said and "--force" in said
    assert "Traceback" not in result.output


# ---- choosing rollouts, over a fake read model -----------------------------------------------


def rollout(rollout_id: str, status: str, **fields: Any) -> Rollout:
    now = datetime(2026, 11, 24, tzinfo=UTC)
    values: dict[str, Any] = {name: None for name in Rollout.model_fields}
    values.update(
        rollout_id=rollout_id, status=status, mode="train", metadata={}, attempt_count=0,
        first_queued_at=now, updated_at=now,
    )  # fmt: skip
    return Rollout(**{**values, **fields})


class FakeReadModel:
    """The two queries cancelling asks, over a list; records the filters it was given."""

    def __init__(self, rollouts: list[Rollout]) -> None:
        self.by_id = {r.rollout_id: r for r in rollouts}
        self.filters: list[RolloutFilter] = []

    async def rollouts_by_id(self, rollout_ids: Iterable[str]) -> dict[str, Rollout]:
        return {i: self.by_id[i] for i in rollout_ids if i in self.by_id}

    async def rollouts(self, f: RolloutFilter) -> Page[Rollout]:
        self.filters.append(f)
        assert f.sort == "id" and not f.descending
        after = "" if f.cursor is None else decode_cursor(f.cursor, "id", False)[1]
        matching = sorted(
            (r for r in self.by_id.values() if r.status in f.status and r.rollout_id > after
             and all(r.metadata.get(k) == v for k, v in f.metadata.items())),
            key=lambda r: r.rollout_id,
        )  # fmt: skip
        page = matching[: f.limit]
        more = len(matching) > f.limit
        cursor = encode_cursor("id", False, page[-1].rollout_id, page[-1].rollout_id)
        return Page[Rollout](items=page, next_cursor=cursor if more else None)


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeReadModel, list[list[str]]]:
    """The CLI over a fake read model; what it would cancel is recorded, not sent."""
    fake = FakeReadModel(
        [
            rollout("ro-queued", "queuing", metadata={"batch": "7"}),
            rollout("ro-running", "running", metadata={"batch": "7"}, attempt_count=1),
            rollout("ro-retry", "requeuing", metadata={"batch": "8"}),
            rollout("ro-done", "succeeded", metadata={"batch": "7"}),
        ]
    )
    sent: list[list[str]] = []

    @asynccontextmanager
    async def open_fake(*_: Any) -> AsyncIterator[FakeReadModel]:
        yield fake

    async def record(_: KafkaSettings, ids: list[str], *__: Any) -> list[str]:
        sent.append(list(ids))
        return list(ids)

    monkeypatch.setattr(ReadModel, "open", open_fake)
    monkeypatch.setattr("agl_stream.cli.cancel.cancel", record)
    return fake, sent


def test_unknown_ids_cancel_nothing_and_are_named(
    world: tuple[FakeReadModel, list[list[str]]],
) -> None:
    _, sent = world
    result = invoke("ro-queued", "ro-never", "ro-typo")
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "the read model has no rollout 'ro-never', 'ro-typo'" in text
    assert "nothing was cancelled" in text and "--force" in text
    assert sent == []


def test_ids_that_are_open_are_cancelled_and_finished_ones_left_alone(
    world: tuple[FakeReadModel, list[list[str]]],
) -> None:
    _, sent = world
    result = invoke("ro-running", "ro-done", "ro-queued", "ro-running", "--print-ids")
    assert result.exit_code == 0, result.output
    assert sent == [["ro-running", "ro-queued"]]
    assert result.stdout.split() == ["ro-running", "ro-queued"]
    assert "already finished, left as they are: ro-done (succeeded)" in result.stderr


def test_only_finished_ids_is_nothing_to_cancel(
    world: tuple[FakeReadModel, list[list[str]]],
) -> None:
    _, sent = world
    result = invoke("ro-done")
    assert result.exit_code == 0, result.output
    assert "nothing to cancel" in result.output
    assert sent == []


def test_force_skips_the_lookup(world: tuple[FakeReadModel, list[list[str]]]) -> None:
    fake, sent = world
    result = invoke("--force", "ro-never", "ro-done")
    assert result.exit_code == 0, result.output
    assert sent == [["ro-never", "ro-done"]]
    assert fake.filters == []


def test_a_filter_cancels_every_open_match(world: tuple[FakeReadModel, list[list[str]]]) -> None:
    fake, sent = world
    result = invoke("--metadata", "batch=7")
    assert result.exit_code == 0, result.output
    assert sent == [["ro-queued", "ro-running"]]  # ro-done matches but has finished
    assert fake.filters[0].status == OPEN_STATUSES
    assert "asked to cancel 2 rollouts" in result.output


def test_a_dry_run_shows_the_table_and_cancels_nothing(
    world: tuple[FakeReadModel, list[list[str]]],
) -> None:
    _, sent = world
    result = CliRunner().invoke(
        cli, ["cancel", "--status", "requeuing", "--status", "running", "--dry-run"],
        env={**NOBODY, "COLUMNS": "200"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "would cancel (2)" in result.output
    rows = [line for line in result.output.splitlines() if "ro-" in line]
    assert [line.split()[1] for line in rows] == ["ro-retry", "ro-running"]
    assert "requeuing" in rows[0] and "running" in rows[1]
    assert sent == []


async def test_a_filter_reads_every_page() -> None:
    fake = FakeReadModel([rollout(f"ro-{i:04}", "queuing") for i in range(2500)])
    found = await select_by_filter(fake, RolloutFilter.of(limit=5))  # type: ignore[arg-type]
    assert [r.rollout_id for r in found] == [f"ro-{i:04}" for i in range(2500)]
    assert len(fake.filters) == 3


async def test_a_filter_for_finished_rollouts_is_refused() -> None:
    with pytest.raises(CancelError, match="status succeeded is not one of queuing"):
        await select_by_filter(FakeReadModel([]), RolloutFilter.of(status=("succeeded",)))  # type: ignore[arg-type]


# ---- what cancel() sends ---------------------------------------------------------------------


class FakeProducer:
    def __init__(self) -> None:
        self.records: list[tuple[str, bytes, bytes]] = []

    async def send(self, topic: str, value: bytes, key: bytes, **_: Any) -> asyncio.Future[None]:
        self.records.append((topic, key, value))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


async def test_cancel_sends_one_request_per_id_keyed_by_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeProducer()

    @asynccontextmanager
    async def producer(*_: Any, **__: Any) -> AsyncIterator[FakeProducer]:
        yield fake

    monkeypatch.setattr(cancel_module, "producer", producer)
    kafka = KafkaSettings(topic_prefix="x.")
    ids = await cancel(kafka, ["ro-1", "ro-2", "ro-1"], reason="wrong prompt", requested_by="me")
    assert ids == ["ro-1", "ro-2"]
    assert [(topic, key) for topic, key, _ in fake.records] == [
        ("x.tasks", b"ro-1"),
        ("x.tasks", b"ro-2"),
    ]
    events = [Codec().decode(value) for _, _, value in fake.records]
    assert all(isinstance(e, RolloutCancelled) for e in events)
    assert [(e.rollout_id, e.reason, e.requested_by) for e in events] == [  # type: ignore[attr-defined]
        ("ro-1", "wrong prompt", "me"),
        ("ro-2", "wrong prompt", "me"),
    ]
    fake.records.clear()
    assert await cancel(kafka, "ro-3") == ["ro-3"]  # one string is one id, not its letters
    assert [key for _, key, _ in fake.records] == [b"ro-3"]


async def test_cancel_refuses_a_bad_id_before_connecting() -> None:
    nobody = KafkaSettings(bootstrap_servers=NOBODY["AGL_STREAM_BOOTSTRAP_SERVERS"])
    with pytest.raises(CancelError, match="rollout_id"):
        await cancel(nobody, ["ro-1", ""])
    assert await cancel(nobody, []) == []
