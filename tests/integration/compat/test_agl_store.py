"""AglStreamStore against Agent Lightning 0.3's documented store contract (LightningStore's
docstrings), on the real broker and database: statuses, retries, sequence ids, pagination
totals, the watchdog, read-your-writes, fencing and a restart that loses nothing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import MessageSizeTooLargeError

from agl_stream.bus.codec import Codec
from agl_stream.compat.agl import AglStreamStore, commit
from agl_stream.compat.agl.core import CATCH_UP_SECONDS, Core, StoreFenced, transactional_id
from agl_stream.compat.agl.reads import Match
from agl_stream.events import AglRecordKind, AglRecordRevised
from tests.support.agl_fixtures import Place, fresh_place, otel_span
from tests.support.backends import Backend

from agentlightning.types import (  # isort: skip  (after agl_stream.compat.agl)
    LLM,
    AttemptedRollout,
    EnqueueRolloutRequest,
    OtelResource,
    PaginatedResult,
    PromptTemplate,
    Rollout,
    RolloutConfig,
    Span,
    SpanContext,
    TraceStatus,
)


@pytest.fixture(scope="module")
async def place(embedded_backend: Backend) -> AsyncIterator[Place]:
    async with fresh_place(embedded_backend) as p:
        yield p


@pytest.fixture(scope="module")
async def store(place: Place) -> AsyncIterator[AglStreamStore]:
    s = AglStreamStore(place.kafka, place.database)
    yield s
    await s.aclose()


def span(
    rollout_id: str, attempt_id: str, seq: int, name: str = "s", parent: str | None = None
) -> Span:
    trace, sid = f"{seq:032x}", f"{seq:016x}"
    return Span(
        rollout_id=rollout_id, attempt_id=attempt_id, sequence_id=seq, trace_id=trace,
        span_id=sid, parent_id=parent, name=name, status=TraceStatus(status_code="OK"),
        attributes={"k": seq}, events=[], links=[], start_time=1.5, end_time=2.5,
        context=SpanContext(trace_id=trace, span_id=sid, is_remote=False, trace_state={}),
        parent=None, resource=OtelResource(attributes={"service.name": "t"}, schema_url=""),
    )  # fmt: skip


async def drain(store: AglStreamStore) -> None:
    """Claim whatever earlier tests left queued, so FIFO checks see only their own."""
    while await store.dequeue_rollout() is not None:
        pass


async def test_enqueue_keeps_every_field_and_start_time(store: AglStreamStore) -> None:
    config = RolloutConfig(timeout_seconds=12.0, max_attempts=3, retry_condition=["timeout"])
    metadata = {"key": "value", "nested": {"n": [1, 2.5, None]}}
    before = time.time()
    r = await store.enqueue_rollout(input={"q": "2+2"}, config=config, metadata=metadata)
    assert r.rollout_id.startswith("ro-") and r.status == "queuing" and r.mode is None
    assert r.start_time >= before and r.end_time is None
    stored = await store.get_rollout_by_id(r.rollout_id)
    assert type(stored) is Rollout  # no attempt yet: not an AttemptedRollout
    assert stored == r  # read-your-writes, every field as given
    assert await store.get_rollout_by_id("ro-missing") is None


async def test_dequeue_is_fifo_and_skips_rollouts_no_longer_queuing(store: AglStreamStore) -> None:
    await drain(store)
    made = await store.enqueue_many_rollouts(
        [EnqueueRolloutRequest(input={"i": i}, mode="train") for i in range(5)]
    )
    assert [r.input["i"] for r in made] == list(range(5))
    await store.update_rollout(made[0].rollout_id, status="failed")
    got = [await store.dequeue_rollout(worker_id="w-fifo") for _ in range(4)]
    assert [g.input["i"] for g in got if g] == [1, 2, 3, 4]
    assert all(g is not None and g.status == "preparing" for g in got)
    assert all(g.attempt.sequence_id == 1 and g.attempt.status == "preparing" for g in got if g)
    assert await store.dequeue_rollout(worker_id="w-fifo") is None
    worker = await store.get_worker_by_id("w-fifo")
    assert worker is not None and worker.status == "idle" and worker.last_dequeue_time


async def test_requeue_creates_the_next_attempt_once(store: AglStreamStore) -> None:
    await drain(store)
    r = await store.enqueue_rollout(input={"requeue": 1})
    first = await store.dequeue_rollout()
    assert first is not None and first.rollout_id == r.rollout_id
    await store.update_rollout(r.rollout_id, status="requeuing")
    await store.update_rollout(r.rollout_id, status="requeuing")  # already queued: once
    second = await store.dequeue_rollout()
    assert second is not None and second.attempt.sequence_id == 2
    assert await store.dequeue_rollout() is None
    attempts = await store.query_attempts(r.rollout_id)
    assert [a.sequence_id for a in attempts] == [1, 2] and attempts.total == 2


async def test_concurrent_dequeues_hand_each_rollout_out_once(store: AglStreamStore) -> None:
    await drain(store)
    made = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i) for i in range(12)])
    results = await asyncio.gather(*(store.dequeue_rollout() for _ in range(18)))
    claimed = [r.rollout_id for r in results if r is not None]
    assert sorted(claimed) == sorted(r.rollout_id for r in made)
    assert sum(r is None for r in results) == 6


async def test_retry_condition_requeues_until_attempts_run_out(store: AglStreamStore) -> None:
    config = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    started = await store.start_rollout(input="retry", config=config, worker_id="w-retry")
    assert started.status == "preparing" and started.attempt.sequence_id == 1
    worker = await store.get_worker_by_id("w-retry")
    assert worker is not None and worker.status == "busy"
    assert worker.current_attempt_id == started.attempt.attempt_id
    failed = await store.update_attempt(started.rollout_id, "latest", status="failed")
    assert failed.end_time is not None
    assert (await store.get_rollout_by_id(started.rollout_id)).status == "requeuing"  # type: ignore[union-attr]
    assert (await store.get_worker_by_id("w-retry")).status == "idle"  # type: ignore[union-attr]
    again = await store.start_attempt(started.rollout_id)
    assert again.attempt.sequence_id == 2
    await store.update_attempt(started.rollout_id, again.attempt.attempt_id, status="failed")
    final = await store.get_rollout_by_id(started.rollout_id)
    assert final is not None and final.status == "failed" and final.end_time is not None


async def test_only_the_latest_attempt_moves_the_rollout(store: AglStreamStore) -> None:
    r = await store.enqueue_rollout(input="latest")
    a1 = await store.start_attempt(r.rollout_id)
    a2 = await store.start_attempt(r.rollout_id)
    await store.update_attempt(r.rollout_id, a1.attempt.attempt_id, status="succeeded")
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "preparing"  # type: ignore[union-attr]
    got = await store.get_rollout_by_id(r.rollout_id)
    assert isinstance(got, AttemptedRollout) and got.attempt.attempt_id == a2.attempt.attempt_id
    await store.update_attempt(r.rollout_id, "latest", status="succeeded", metadata={"m": 1})
    got = await store.get_rollout_by_id(r.rollout_id)
    assert got is not None and got.status == "succeeded"
    with pytest.raises(ValueError, match="Attempt at-nope not found"):
        await store.update_attempt(r.rollout_id, "at-nope", status="failed")
    fresh = await store.enqueue_rollout(input="none")
    with pytest.raises(ValueError, match="No attempts found"):
        await store.update_attempt(fresh.rollout_id, "latest", status="failed")
    with pytest.raises(ValueError, match="does not exist"):
        await store.update_rollout("ro-missing", status="failed")
    with pytest.raises(ValueError, match="Rollout ro-missing not found"):
        await store.start_attempt("ro-missing")


async def test_spans_sequence_ids_heartbeat_and_duplicates(
    store: AglStreamStore, caplog: pytest.LogCaptureFixture
) -> None:
    await drain(store)
    r = await store.enqueue_rollout(input="spans")
    d = await store.dequeue_rollout()
    assert d is not None and d.rollout_id == r.rollout_id
    rid, aid = r.rollout_id, d.attempt.attempt_id
    assert await store.get_next_span_sequence_id(rid, aid) == 1
    s2 = await store.add_otel_span(rid, aid, otel_span("first", answer=42))
    assert s2 is not None and s2.sequence_id == 2 and s2.attributes == {"answer": 42}
    attempt = await store.get_latest_attempt(rid)
    assert attempt is not None and attempt.status == "running" and attempt.last_heartbeat_time
    assert (await store.get_rollout_by_id(rid)).status == "running"  # type: ignore[union-attr]
    explicit = await store.add_otel_span(rid, aid, otel_span("explicit"), sequence_id=100)
    assert explicit is not None and explicit.sequence_id == 100
    assert await store.get_many_span_sequence_ids([(rid, aid), (rid, aid)]) == [101, 102]
    caplog.set_level(logging.ERROR)
    dup = span(rid, aid, 7)
    assert await store.add_span(dup) is dup
    assert await store.add_span(dup) is None
    assert "Duplicated span added" in caplog.text
    spans = await store.query_spans(rid)
    assert [s.sequence_id for s in spans] == [2, 7, 100] and spans.total == 3
    with pytest.raises(ValueError, match="Rollout ro-missing not found"):
        await store.add_span(span("ro-missing", aid, 1))
    with pytest.raises(ValueError, match="Attempt at-missing not found"):
        await store.add_span(span(rid, "at-missing", 1))


async def test_concurrent_span_additions_get_distinct_sequence_ids(store: AglStreamStore) -> None:
    a = await store.start_rollout(input="many spans")
    added = await asyncio.gather(
        *(store.add_otel_span(a.rollout_id, a.attempt.attempt_id, otel_span()) for _ in range(20))
    )
    assert sorted(s.sequence_id for s in added if s) == list(range(1, 21))


async def test_a_span_revives_an_unresponsive_attempt_but_not_a_timed_out_one(
    store: AglStreamStore,
) -> None:
    config = RolloutConfig(max_attempts=2, retry_condition=["unresponsive"])
    a = await store.start_rollout(input="revive", config=config)
    await store.update_attempt(a.rollout_id, a.attempt.attempt_id, status="unresponsive")
    assert (await store.get_rollout_by_id(a.rollout_id)).status == "requeuing"  # type: ignore[union-attr]
    await store.add_otel_span(a.rollout_id, a.attempt.attempt_id, otel_span())
    latest = await store.get_latest_attempt(a.rollout_id)
    assert latest is not None and latest.status == "running" and latest.sequence_id == 1
    assert (await store.get_rollout_by_id(a.rollout_id)).status == "running"  # type: ignore[union-attr]
    b = await store.start_rollout(input="timed out")
    await store.update_attempt(b.rollout_id, "latest", status="timeout")
    before = await store.get_rollout_by_id(b.rollout_id)
    await store.add_otel_span(b.rollout_id, b.attempt.attempt_id, otel_span())
    after = await store.get_latest_attempt(b.rollout_id)
    assert after is not None and after.status == "timeout" and after.last_heartbeat_time
    assert (await store.get_rollout_by_id(b.rollout_id)).status == before.status  # type: ignore[union-attr]


async def test_query_spans_filters_sorts_and_pages(store: AglStreamStore) -> None:
    a = await store.start_rollout(input="span filters")
    rid, aid = a.rollout_id, a.attempt.attempt_id
    made = [
        span(rid, aid, 1, "reward"),
        span(rid, aid, 2, "planner", parent=f"{1:016x}"),
        span(rid, aid, 3, "tool-call", parent=f"{2:016x}"),
    ]
    assert len(await store.add_many_spans(made)) == 3
    by_trace = await store.query_spans(rid, trace_id=made[1].trace_id)
    assert [s.span_id for s in by_trace] == [made[1].span_id]
    either = await store.query_spans(
        rid, span_id=made[0].span_id, name_contains="tool", filter_logic="or"
    )
    assert {s.span_id for s in either} == {made[0].span_id, made[2].span_id}
    child = await store.query_spans(rid, parent_id_contains=made[1].span_id[-4:])
    assert [s.span_id for s in child] == [made[2].span_id]
    page = await store.query_spans(rid, sort_by="span_id", sort_order="desc", limit=1, offset=1)
    assert isinstance(page, PaginatedResult)
    assert [s.span_id for s in page] == [made[1].span_id] and page.total == 3
    back = (await store.query_spans(rid, attempt_id="latest"))[2]
    assert back.parent_id == made[1].span_id and back.attributes == {"k": 3}
    assert back.start_time == 1.5 and back.resource.attributes == {"service.name": "t"}
    assert len(await store.query_spans(rid, attempt_id="at-other")) == 0
    assert len(await store.query_spans("ro-none", attempt_id="latest")) == 0


async def test_query_rollouts_filters_sort_pagination_and_totals(store: AglStreamStore) -> None:
    made = [await store.enqueue_rollout(input={"q": i}) for i in range(4)]
    ids = [r.rollout_id for r in made]
    await store.update_rollout(ids[0], status="failed")
    await store.update_rollout(ids[3], status="failed")
    failed = await store.query_rollouts(status_in=["failed"], rollout_id_in=ids)
    assert {r.rollout_id for r in failed} == {ids[0], ids[3]}
    either = await store.query_rollouts(
        status_in=["failed"], rollout_id_contains=ids[2][-6:], filter_logic="or",
        sort_by="rollout_id", limit=2, offset=1,
    )  # fmt: skip
    assert either.total >= 3 and len(either) == 2
    mine = await store.query_rollouts(rollout_id_in=ids, sort_by="rollout_id", sort_order="desc")
    assert [r.rollout_id for r in mine] == sorted(ids, reverse=True)
    page = await store.query_rollouts(rollout_id_in=ids, sort_by="rollout_id", limit=1, offset=1)
    assert [r.rollout_id for r in page] == sorted(ids)[1:2]
    assert (page.limit, page.offset, page.total) == (1, 1, 4)
    assert len(await store.query_rollouts(rollout_id_in=ids, status_in=[])) == 0
    assert len(await store.query_rollouts(rollout_id_in=ids, limit=0)) == 0
    with pytest.raises(ValueError, match="cannot sort by 'nope'"):
        await store.query_rollouts(sort_by="nope")


async def test_update_rollout_replaces_fields_and_stamps_end_time(store: AglStreamStore) -> None:
    r = await store.enqueue_rollout(input="x", mode="train", metadata={"a": 1})
    config = RolloutConfig(timeout_seconds=60.0, max_attempts=3, retry_condition=["timeout"])
    updated = await store.update_rollout(
        r.rollout_id, input={"new": True}, mode=None, resources_id="rs-x", config=config,
        metadata=None, status="succeeded",
    )  # fmt: skip
    assert updated.end_time is not None and updated.end_time >= r.start_time
    stored = await store.get_rollout_by_id(r.rollout_id)
    assert stored == updated
    assert stored.input == {"new": True} and stored.mode is None and stored.metadata is None  # type: ignore[union-attr]


async def test_watchdog_times_out_and_retries_and_marks_silence(store: AglStreamStore) -> None:
    await drain(store)
    timed = await store.enqueue_rollout(
        input="slow",
        config=RolloutConfig(timeout_seconds=0.2, max_attempts=2, retry_condition=["timeout"]),
    )
    silent = await store.enqueue_rollout(
        input="silent", config=RolloutConfig(unresponsive_seconds=0.2)
    )
    first = await store.dequeue_rollout(worker_id="w-dog")
    second = await store.dequeue_rollout(worker_id="w-dog2")
    assert first is not None and second is not None
    await store.add_otel_span(timed.rollout_id, first.attempt.attempt_id, otel_span())
    await asyncio.sleep(0.3)  # past both limits; the next call's watchdog sees it
    attempts = await store.query_attempts(timed.rollout_id)
    assert [a.status for a in attempts] == ["timeout"]
    assert (await store.get_rollout_by_id(timed.rollout_id)).status == "requeuing"  # type: ignore[union-attr]
    assert (await store.get_rollout_by_id(silent.rollout_id)).status == "failed"  # type: ignore[union-attr]
    assert (await store.get_worker_by_id("w-dog2")).status == "unknown"  # type: ignore[union-attr]
    retry = await store.dequeue_rollout()
    assert retry is not None and retry.rollout_id == timed.rollout_id
    assert retry.attempt.sequence_id == 2


async def test_resources_versions_latest_and_queries(store: AglStreamStore) -> None:
    llm = LLM(endpoint="http://127.0.0.1:1/v1", model="m1", sampling_parameters={"stop": ["\n"]})
    first = await store.add_resources({"llm": llm})
    assert first.resources_id.startswith("rs-") and len(first.resources_id) == 15
    assert first.version == 1 and first.create_time == first.update_time
    second = await store.update_resources(
        first.resources_id, {"llm": llm.model_copy(update={"model": "m2"})}
    )
    assert second.version == 2 and second.create_time == first.create_time
    assert second.update_time > first.update_time
    latest = await store.get_latest_resources()
    assert latest == second and latest.resources["llm"].model == "m2"
    manual = await store.update_resources(
        "manual-zeta", {"p": PromptTemplate(template="Hi {name}", engine="f-string")}
    )
    assert manual.version == 1 and (await store.get_latest_resources()) == manual
    queued = await store.enqueue_rollout(input="inherits")
    assert queued.resources_id == "manual-zeta"
    found = await store.query_resources(resources_id_contains="manual-")
    assert [r.resources_id for r in found] == ["manual-zeta"]
    page = await store.query_resources(sort_by="resources_id", sort_order="desc", limit=1, offset=1)
    assert page.total >= 2 and len(page) == 1
    assert await store.get_resources_by_id("nope") is None


async def test_workers_heartbeats_survive_attempt_syncs_and_filter(store: AglStreamStore) -> None:
    first = await store.update_worker("alpha-w", heartbeat_stats={"cpu": 0.5})
    assert first.status == "unknown" and first.heartbeat_stats == {"cpu": 0.5}
    a = await store.start_rollout(input="busy", worker_id="alpha-w")
    busy = await store.get_worker_by_id("alpha-w")
    assert busy is not None and busy.status == "busy" and busy.heartbeat_stats == {"cpu": 0.5}
    assert busy.last_heartbeat_time == first.last_heartbeat_time and busy.last_busy_time
    await store.update_worker("beta-w")
    found = await store.query_workers(status_in=["busy"], worker_id_contains="-w")
    assert "alpha-w" in [w.worker_id for w in found]
    either = await store.query_workers(
        status_in=["busy"], worker_id_contains="beta-w", filter_logic="or", sort_by="worker_id"
    )
    names = [w.worker_id for w in either]
    assert names.index("alpha-w") < names.index("beta-w")
    await store.update_attempt(a.rollout_id, "latest", status="succeeded")
    idle = await store.get_worker_by_id("alpha-w")
    assert idle is not None and idle.status == "idle" and idle.current_rollout_id is None
    assert idle.heartbeat_stats == {"cpu": 0.5}
    with pytest.raises(TypeError):
        await store.update_worker("alpha-w", heartbeat_stats=None)  # type: ignore[arg-type]


async def test_wait_for_rollouts(store: AglStreamStore) -> None:
    r1 = await store.enqueue_rollout(input=1)
    r2 = await store.enqueue_rollout(input=2)
    assert await store.wait_for_rollouts(rollout_ids=[r1.rollout_id], timeout=0) == []
    waiting = asyncio.create_task(
        store.wait_for_rollouts(rollout_ids=[r1.rollout_id, r2.rollout_id], timeout=30)
    )
    await store.update_rollout(r1.rollout_id, status="succeeded")
    await store.update_rollout(r2.rollout_id, status="cancelled")
    done = await waiting  # returns as soon as both finished, not at its timeout
    assert {(r.rollout_id, r.status) for r in done} == {
        (r1.rollout_id, "succeeded"),
        (r2.rollout_id, "cancelled"),
    }
    quick = await store.wait_for_rollouts(rollout_ids=[r1.rollout_id], timeout=None)
    assert [r.rollout_id for r in quick] == [r1.rollout_id]
    partial = await store.wait_for_rollouts(rollout_ids=[r1.rollout_id, "ro-none"], timeout=0.2)
    assert [r.rollout_id for r in partial] == [r1.rollout_id]


async def test_statistics_count_what_was_added(store: AglStreamStore) -> None:
    before = await store.statistics()
    a = await store.start_rollout(input="stats")
    await store.add_otel_span(a.rollout_id, a.attempt.attempt_id, otel_span())
    await store.add_resources({"llm": LLM(endpoint="http://x", model="m")})
    await store.update_worker("stats-worker", heartbeat_stats={})
    after = await store.statistics()
    for key in ("rollouts", "attempts", "spans", "resources", "workers"):
        assert after[f"total_{key}"] == before[f"total_{key}"] + 1, key  # type: ignore[literal-required]
    assert after["name"] == "AglStreamStore" and after["uptime"] > before["uptime"]


async def test_any_loop_and_thread_may_call(store: AglStreamStore) -> None:
    r = await store.enqueue_rollout(input="threads")

    def elsewhere() -> Rollout | None:
        return asyncio.run(store.get_rollout_by_id(r.rollout_id))

    got = await asyncio.to_thread(elsewhere)
    assert got is not None and got.rollout_id == r.rollout_id


async def test_a_restarted_store_loses_nothing_and_a_second_fences_the_first(
    embedded_backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    async with fresh_place(embedded_backend) as place:
        first = AglStreamStore(place.kafka, place.database)
        kept = await first.enqueue_rollout(input="kept", mode="val", metadata={"k": [1]})
        a = await first.start_rollout(input="spans", worker_id="w-restart")
        seqs = await first.get_many_span_sequence_ids([(a.rollout_id, a.attempt.attempt_id)] * 3)
        assert seqs == [1, 2, 3]
        await first.add_otel_span(a.rollout_id, a.attempt.attempt_id, otel_span(), sequence_id=2)
        res = await first.add_resources({"p": PromptTemplate(template="t", engine="jinja")})
        await first.aclose()
        # A store killed inside a transaction: the next one aborts it and does not wait for
        # the projection to pass what the abort left (it reads the stable offsets first).
        killed = AIOKafkaProducer(
            transactional_id=transactional_id(place.kafka), **place.kafka.client_options()
        )
        await killed.start()
        await killed.begin_transaction()
        await killed.send_and_wait(
            place.kafka.topic_prefix + "rollouts", key=b"ro-ghost", value=Codec().encode(ghost())
        )

        caplog.set_level(logging.WARNING, logger="agl_stream.compat.agl.core")
        began = time.monotonic()
        second = AglStreamStore(place.kafka, place.database)
        try:
            assert await second.get_rollout_by_id("ro-ghost") is None  # aborted
            assert time.monotonic() - began < CATCH_UP_SECONDS
            assert "the store waits for the read model" not in caplog.text
            assert await second.get_rollout_by_id(kept.rollout_id) == kept
            assert [s.sequence_id for s in await second.query_spans(a.rollout_id)] == [2]
            assert await second.get_latest_resources() == res
            worker = await second.get_worker_by_id("w-restart")
            assert worker is not None and worker.status == "busy"
            # Past every id the first store may have handed out (its reserved block).
            assert await second.get_next_span_sequence_id(a.rollout_id, "any") > 3
            claimed = await second.dequeue_rollout()
            assert claimed is not None and claimed.rollout_id == kept.rollout_id

            third = AglStreamStore(place.kafka, place.database)  # fences the second
            try:
                await third.enqueue_rollout(input="after")
                with pytest.raises(StoreFenced, match="took over"):
                    await second.enqueue_rollout(input="zombie")
                assert await third.dequeue_rollout() is not None
            finally:
                await third.aclose()
        finally:
            await second.aclose()
            with contextlib.suppress(Exception):  # fenced: its stop may complain
                await killed.stop()


def ghost() -> AglRecordRevised:
    body = {"record": Rollout(rollout_id="ro-ghost", input=0, start_time=1.0).model_dump()}
    return AglRecordRevised(
        kind=AglRecordKind.ROLLOUT, partition_key="ro-ghost", record_id="ro-ghost",
        rollout_id="ro-ghost", revision=1, created_at=datetime.now(UTC), body_json=json.dumps(body),
    )  # fmt: skip


async def _core(store: AglStreamStore) -> Core:
    async def get(core: Core) -> Core:
        return core

    return await store._run(get)


async def test_calls_in_flight_share_the_next_transaction(embedded_backend: Backend) -> None:
    async with fresh_place(embedded_backend) as place:
        await _share_a_transaction(AglStreamStore(place.kafka, place.database))


async def _share_a_transaction(store: AglStreamStore) -> None:
    try:
        a = await store.start_rollout(input="burst")
        core = await _core(store)
        before = core.commits.transactions
        added = await asyncio.gather(
            *(store.add_span(span(a.rollout_id, a.attempt.attempt_id, seq)) for seq in range(1, 41))
        )
        assert all(s is not None for s in added)
        assert core.commits.transactions - before < 40  # some calls shared a commit
        stored = await store.query_spans(a.rollout_id)
        assert sorted(s.sequence_id for s in stored) == list(range(1, 41))
        # A record too large fails its own call only, not the calls it would share a commit with.
        huge = span(a.rollout_id, a.attempt.attempt_id, 41).model_copy(
            update={"attributes": {"blob": "x" * 2_000_000}}
        )
        results = await asyncio.gather(
            store.add_span(huge),
            store.add_span(span(a.rollout_id, a.attempt.attempt_id, 42)),
            return_exceptions=True,
        )
        assert isinstance(results[0], MessageSizeTooLargeError)
        assert isinstance(results[1], Span) and results[1].sequence_id == 42
        assert core.commits.failure is None
    finally:
        await store.aclose()


async def test_a_commit_the_broker_does_not_answer_fails_its_calls_and_the_store_recovers(
    embedded_backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not embedded_backend.can_pause:
        pytest.skip(f"the {embedded_backend.name} backend cannot freeze its broker")
    monkeypatch.setattr(commit, "COMMIT_SECONDS", 2.0)
    async with fresh_place(embedded_backend) as place:
        await _recover_from_a_frozen_broker(
            AglStreamStore(place.kafka, place.database), embedded_backend
        )


async def _recover_from_a_frozen_broker(store: AglStreamStore, embedded_backend: Backend) -> None:
    try:
        await drain(store)
        kept = await store.enqueue_rollout(input="before")
        frozen = asyncio.create_task(embedded_backend.pause_broker(8))
        await asyncio.sleep(0.5)
        began = time.monotonic()
        with pytest.raises(TimeoutError, match="did not commit the store's transaction"):
            await store.update_worker("w-frozen", heartbeat_stats={"frozen": True})
        assert time.monotonic() - began < 6  # it gave up while the broker was still frozen
        await frozen
        # The next call rebuilds the store's state from the topics and the read model.
        claimed = await store.dequeue_rollout()
        assert claimed is not None and claimed.rollout_id == kept.rollout_id
        # The frozen commit may have gone through after the thaw: memory and read model agree.
        answer = await store.get_worker_by_id("w-frozen")
        await store._run(lambda core: core.projected())
        row = await store._run(lambda core: core.reads.record("worker", "w-frozen"))
        assert (answer is None) == (row is None)
    finally:
        await store.aclose()


async def test_finished_rollouts_are_forgotten_and_read_back_alike(
    embedded_backend: Backend,
) -> None:
    async with fresh_place(embedded_backend) as place:
        await _forget_and_read_back(AglStreamStore(place.kafka, place.database))


async def _forget_and_read_back(store: AglStreamStore) -> None:
    try:
        await drain(store)
        core = await _core(store)
        core.live.kept = 3
        finished = []
        for i in range(8):
            r = await store.start_rollout(input={"i": i})
            await store.add_span(span(r.rollout_id, r.attempt.attempt_id, 1))
            await store.update_attempt(r.rollout_id, "latest", status="succeeded")
            finished.append(await store.get_rollout_by_id(r.rollout_id))
        queued = await store.enqueue_rollout(input="live")
        deadline = time.monotonic() + 30
        while len(core.live.rollouts) > 3 and time.monotonic() < deadline:
            await store.update_worker("w-nudge")  # a write looks at the memory's size
            await asyncio.sleep(0.2)
        assert len(core.live.rollouts) <= 3
        assert queued.rollout_id in core.live.rollouts  # the queue is never forgotten
        for before in finished:
            assert before is not None
            assert await store.get_rollout_by_id(before.rollout_id) == before
            spans = await store.query_spans(before.rollout_id, "latest")
            assert [s.sequence_id for s in spans] == [1]
    finally:
        await store.aclose()


async def test_answers_from_memory_equal_the_read_models(store: AglStreamStore) -> None:
    made = [await store.enqueue_rollout(input={"q": i}, mode="train") for i in range(5)]
    ids = [r.rollout_id for r in made]
    claimed = await store.start_attempt(ids[1])
    await store.update_attempt(ids[1], claimed.attempt.attempt_id, status="failed")
    await store.start_attempt(ids[1])
    await store.update_rollout(ids[2], mode="val")
    core = await _core(store)
    await store._run(lambda core: core.projected())
    for sort_by in (None, "rollout_id", "start_time", "end_time", "mode", "status"):
        for order in ("asc", "desc"):
            memory = await store.query_rollouts(
                rollout_id_in=ids, sort_by=sort_by, sort_order=order
            )
            rows, total = await store._run(
                lambda core, s=sort_by, o=order: core.reads.records(
                    "rollout",
                    Rollout,
                    matches=[Match("record_id", within=ids)],
                    sort_by=s,
                    sort_order=o,
                )
            )
            assert [r.rollout_id for r in memory] == [r.record_id for r in rows], (sort_by, order)
            assert memory.total == total
    attempts = await store.query_attempts(ids[1], sort_order="desc")
    assert [a.sequence_id for a in attempts] == [2, 1]
    assert core.live.rollouts[ids[1]].latest() is not None


async def test_an_empty_worker_id_takes_the_attempt_from_its_worker(store: AglStreamStore) -> None:
    """As Agent Lightning's stores do (its test_update_attempt_none_vs_unset): "" is no
    worker, not an id that breaks the id rule."""
    started = await store.start_rollout(input="w", worker_id="w-empty")
    updated = await store.update_attempt(started.rollout_id, "latest", worker_id="", metadata={})
    assert updated.worker_id == "" and updated.metadata == {}
    unassigned = await store.start_rollout(input="none", worker_id="")
    assert not unassigned.attempt.worker_id
