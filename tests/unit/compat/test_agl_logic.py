"""The store facade's pure parts: Agent Lightning's variables, its status rules, the span
mapping and the fold of its records (no broker, no database)."""

from __future__ import annotations

import itertools
import json
import logging
import pickle
import socket
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from agl_stream.agent.emit import emit_message, emitter_debug
from agl_stream.compat.agl import records as logic
from agl_stream.compat.agl.env import EnvError, ServerAddress, otlp_endpoint, server_address
from agl_stream.compat.agl.reads import Match, Sql, page, sort_expression, where
from agl_stream.compat.agl.spans import from_row, to_event
from agl_stream.events import AglRecordKind, AglRecordRevised
from agl_stream.projection.fold import State, project, span_row

from agentlightning.types import (  # isort: skip  (after agl_stream.compat.agl)
    Attempt,
    OtelResource,
    Rollout,
    RolloutConfig,
    Span,
    TraceStatus,
    Worker,
)


def test_server_address_follows_agent_lightnings_variables() -> None:
    assert server_address({}) == ServerAddress("127.0.0.1", 4747)
    url = {"AGENT_LIGHTNING_STORE_URL": "http://10.0.0.5:9999"}
    assert server_address(url) == ServerAddress("10.0.0.5", 9999)
    both = {**url, "AGL_SERVER_HOST": "0.0.0.0", "AGL_SERVER_PORT": "4800"}
    assert server_address(both) == ServerAddress("0.0.0.0", 4800)
    with pytest.raises(EnvError, match="AGL_SERVER_PORT='x'"):
        server_address({"AGL_SERVER_PORT": "x"})
    with pytest.raises(EnvError, match="AGENT_LIGHTNING_STORE_URL='store:4747'"):
        server_address({"AGENT_LIGHTNING_STORE_URL": "store:4747"})
    assert otlp_endpoint(url) == "http://10.0.0.5:9999/v1/traces"
    assert otlp_endpoint({**url, "AGENT_LIGHTNING_OTLP_ENDPOINT": "http://o/v1/traces"}) == (
        "http://o/v1/traces"
    )
    assert otlp_endpoint({}) is None


def test_agl_emitter_debug(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AGL_EMITTER_DEBUG", "maybe")
    with pytest.raises(ValueError, match="AGL_EMITTER_DEBUG must be one of"):
        emitter_debug()
    monkeypatch.setenv("AGL_EMITTER_DEBUG", "yes")
    caplog.set_level(logging.DEBUG, logger="agl_stream.agent.emit")
    emit_message("hello")
    assert "emitted agl.message {'agl.message': 'hello'} for no attempt" in caplog.text
    monkeypatch.setenv("AGL_EMITTER_DEBUG", "0")
    caplog.clear()
    emit_message("quiet")
    assert "quiet" not in caplog.text


def rollout(status: str = "queuing", **config: object) -> logic.RolloutRecord:
    r = Rollout(
        rollout_id="ro-1", input=1, start_time=10.0, status=status,  # type: ignore[arg-type]
        config=RolloutConfig(**config),  # type: ignore[arg-type]
    )  # fmt: skip
    return logic.RolloutRecord(r, revision=1, queued_at=10.0 if status in logic.QUEUING else None)


def attempt(seq: int = 1, status: str = "preparing", **fields: object) -> Attempt:
    return Attempt(
        rollout_id="ro-1", attempt_id=f"at-{seq}", sequence_id=seq, start_time=20.0,
        status=status, **fields,  # type: ignore[arg-type]
    )  # fmt: skip


def test_a_rollout_enters_the_queue_once_and_leaves_it_when_it_runs() -> None:
    queued = rollout("queuing")
    again = logic.with_rollout_status(queued, "requeuing", 30.0)
    assert again.queued_at == 10.0  # already queued: keeps its place
    running = logic.with_rollout_status(again, "running", 31.0)
    assert running.queued_at is None and running.rollout.end_time is None
    back = logic.with_rollout_status(running, "requeuing", 40.0)
    assert back.queued_at == 40.0  # to the tail
    done = logic.with_rollout_status(back, "failed", 50.0)
    assert done.queued_at is None and done.rollout.end_time == 50.0


async def test_the_latest_attempts_status_decides_retries() -> None:
    record = rollout("running", max_attempts=2, retry_condition=["timeout"])
    a1 = attempt(1, "timeout")
    after = await logic.rollout_after_attempt(record, a1, a1, 60.0)
    assert after is not None and after.rollout.status == "requeuing" and after.queued_at == 60.0
    a2 = attempt(2, "timeout")
    assert (await logic.rollout_after_attempt(record, a2, a2, 60.0)).rollout.status == "failed"  # type: ignore[union-attr]
    assert await logic.rollout_after_attempt(record, a1, a2, 60.0) is None  # not the latest
    ok = attempt(1, "succeeded")
    assert (await logic.rollout_after_attempt(record, ok, ok, 60.0)).rollout.end_time == 60.0  # type: ignore[union-attr]


def test_attempt_changes_end_times_and_worker_syncs() -> None:
    a = attempt(worker_id="w")
    running, sync = logic.with_attempt_changes(a, 5.0, {"status": "running"})
    assert running.end_time is None and sync
    timed_out, _ = logic.with_attempt_changes(a, 5.0, {"status": "timeout"})
    assert timed_out.end_time is None  # Agent Lightning 0.3 stamps only failed and succeeded
    done, _ = logic.with_attempt_changes(a, 5.0, {"status": "failed"})
    assert done.end_time == 5.0
    _, sync = logic.with_attempt_changes(attempt(), 5.0, {"metadata": {"x": 1}})
    assert not sync
    w = Worker(worker_id="w", heartbeat_stats={"cpu": 1})
    busy = logic.worker_after_attempt(w, a, 6.0, dequeue=True)
    assert (busy.status, busy.current_attempt_id, busy.last_dequeue_time) == ("busy", "at-1", 6.0)
    idle = logic.worker_after_attempt(busy, done, 7.0, dequeue=False)
    assert (idle.status, idle.current_rollout_id, idle.heartbeat_stats) == (
        "idle",
        None,
        {"cpu": 1},
    )
    lost = logic.worker_after_attempt(busy, timed_out, 8.0, dequeue=False)
    assert lost.status == "unknown"


def test_heartbeats_revive_and_the_watchdog_judges() -> None:
    assert logic.heartbeat(attempt(status="unresponsive"), 3.0).status == "running"
    assert logic.heartbeat(attempt(status="timeout"), 3.0).status == "timeout"
    record = rollout("requeuing")
    assert (
        logic.rollout_after_heartbeat(record, attempt(), attempt(), 3.0).rollout.status == "running"
    )  # type: ignore[union-attr]
    assert logic.rollout_after_heartbeat(rollout("queuing"), attempt(), attempt(), 3.0) is None
    r = rollout("running", timeout_seconds=5.0, unresponsive_seconds=2.0).rollout
    assert logic.unhealthy_status(r, attempt(), 21.0) is None
    assert logic.unhealthy_status(r, attempt(), 22.5) == "unresponsive"  # no heartbeat since start
    assert logic.unhealthy_status(r, attempt(last_heartbeat_time=22.0), 23.0) is None
    assert logic.unhealthy_status(r, attempt(last_heartbeat_time=24.9), 25.5) == "timeout"


def test_spans_map_to_span_recorded_and_back() -> None:
    trace, sid, parent = "ab" * 16, "cd" * 8, "ef" * 8
    span = Span(
        rollout_id="ro-1", attempt_id="at-1", sequence_id=3, trace_id=trace, span_id=sid,
        parent_id=parent, name="llm", status=TraceStatus(status_code="ERROR", description="x"),
        attributes={"a": 1, "b": [1.5, 2.5]}, events=[], links=[], start_time=1.25,
        end_time=None, context=None, parent=None,
        resource=OtelResource(attributes={"service.name": "s"}, schema_url=""),
        kind="SpanKind.CLIENT",
    )  # fmt: skip
    event = to_event(span)
    assert (event.sequence, event.kind.value, event.end_time_unix_nano) == (3, "CLIENT", 0)
    row = span_row(event)
    back = from_row({f: getattr(row, f) for f in row._fields})
    assert back.model_dump(exclude={"context", "parent"}) == span.model_dump(
        exclude={"context", "parent"}
    )
    assert back.parent is not None and back.parent.span_id == parent
    with pytest.raises(ValueError, match="trace_id"):
        to_event(span.model_copy(update={"trace_id": "not hex"}))
    with pytest.raises(ValueError, match="cannot be stored"):
        to_event(span.model_copy(update={"attributes": {"nested": {"x": 1}}}))


def test_the_highest_revision_of_a_record_wins_in_any_order() -> None:
    at = datetime(2026, 1, 1, tzinfo=UTC)
    events = [
        AglRecordRevised(
            kind=AglRecordKind.ROLLOUT, partition_key="ro-1", record_id="ro-1", rollout_id="ro-1",
            revision=n, created_at=at, body_json=json.dumps({"record": {"n": n}}),
            occurred_at=at + timedelta(seconds=n), event_id=uuid.UUID(int=n),
        )
        for n in (1, 2, 3)
    ]  # fmt: skip
    results = set()
    for order in itertools.permutations(events + events[:1]):
        state = State()
        project(order, state)
        (row,) = state.agl_records.values()
        results.add((row.revision, json.dumps(row.body)))
    assert results == {(3, json.dumps({"record": {"n": 3}}))}


def test_filters_pool_with_and_or_and_sorts_follow_the_model() -> None:
    sql = Sql()
    clause = where(
        sql,
        ["kind = 'x'"],
        [Match("a", exact=1, within=["p", "q"]), Match("b", contains="z")],
        "or",
    )
    assert clause == "kind = 'x' AND (a = $1 OR a = ANY($2::text[]) OR strpos(b, $3) > 0)"
    assert sql.params == ["1", ["p", "q"], "z"]
    assert where(Sql(), [], [Match("a", within=[])], "and") == "(false)"
    assert "Infinity" in sort_expression(Rollout, "end_time", "e")
    assert 'COLLATE "C"' in sort_expression(Rollout, "status", "s")
    with pytest.raises(ValueError, match="neither text nor a number"):
        sort_expression(Rollout, "config", "c")
    assert page(-1, 2) == " OFFSET 2" and page(0, 0) == " LIMIT 0 OFFSET 0"
    with pytest.raises(ValueError, match="offset"):
        page(1, -1)


def test_a_store_stays_in_the_process_that_made_it() -> None:
    from agl_stream.compat.agl import AglStreamStore

    store = AglStreamStore()
    with pytest.raises(TypeError, match="AGENT_LIGHTNING_STORE_URL"):
        pickle.dumps(store)
    store._pid = -1  # as in a forked child: AGL_MANAGED_STORE=0 handed it to a runner process
    with pytest.raises(RuntimeError, match="AGL_MANAGED_STORE"):
        store._ensure_loop()


def test_a_taken_port_stops_agl_stream_store_before_its_store_starts() -> None:
    """A second `agl-stream store` on a serving one's port would fence the serving store if
    it started its own first; it must stop at the port. (Kafka is unreachable here: had the
    store started first, the error would be about the brokers.)"""
    from click.testing import CliRunner

    from agl_stream.cli.main import cli

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(
            cli,
            ["--bootstrap-servers", "127.0.0.1:9", "store", "--port", str(port)],
        )
    assert result.exit_code == 1, result.output
    assert f"cannot listen on 127.0.0.1:{port}" in result.output
    bad = CliRunner().invoke(cli, ["store"], env={"AGL_SERVER_PORT": "http"})
    assert bad.exit_code == 2 and "AGL_SERVER_PORT='http' is not a port number" in bad.output
