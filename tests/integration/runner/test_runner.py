"""The runner through the real broker: success with every span present, retries, timeouts,
unresponsive attempts, cancellation, bad tasks, resources, and no head-of-line blocking."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaConnectionError

from agl_stream.bus.kafka import admin_client, end_offsets, producer
from agl_stream.bus.streams import EventPublisher, Topics
from agl_stream.events import (
    AttemptStatus,
    PromptTemplate,
    ResourcesPublished,
    RolloutCancelled,
    RolloutStatus,
)
from agl_stream.queries.dead_letters import read_dead_letters
from agl_stream.runner import worker
from agl_stream.runner.lane import committed_checkpoint
from agl_stream.runtime.config import KafkaSettings
from tests.support.helpers import eventually
from tests.support.runs import (
    History,
    history,
    ids_on_partition,
    queue,
    runner_in_process,
    wait_terminal,
)


def assert_complete(h: History, rollout_id: str) -> None:
    """Exactly one succeeded attempt, and all of its spans, numbered 0..n-1."""
    succeeded = [a for a in h.finished[rollout_id] if a.status == AttemptStatus.SUCCEEDED]
    assert len(succeeded) == 1, (rollout_id, h.finished[rollout_id])
    attempt = succeeded[0]
    spans = h.spans[attempt.attempt_id]
    assert sorted(s.sequence for s in spans) == list(range(attempt.span_count))
    assert attempt.span_count > 0


async def test_rollouts_succeed_with_all_their_spans(kafka: KafkaSettings) -> None:
    tasks = [{"spans": 3, "sleep": 0.1, "reward": i / 10} for i in range(20)]
    ids = await queue(kafka, tasks)
    async with runner_in_process(kafka, concurrency=8) as runner:
        h = await wait_terminal(kafka, ids, 60)
    for rollout_id, task in zip(ids, tasks, strict=True):
        assert h.final(rollout_id).status == RolloutStatus.SUCCEEDED  # type: ignore[union-attr]
        assert_complete(h, rollout_id)
        attempt = h.finished[rollout_id][0]
        assert attempt.reward == task["reward"]
        names = [s.name for s in sorted(h.spans[attempt.attempt_id], key=lambda s: s.sequence)]
        assert names == ["agl.message"] * 3 + ["agl.reward", "agl.attempt"]
        root = next(s for s in h.spans[attempt.attempt_id] if s.name == "agl.attempt")
        assert all(s.trace_id == root.trace_id for s in h.spans[attempt.attempt_id])
    assert runner.counts["rollouts_succeeded"] == 20


async def test_a_slow_rollout_does_not_hold_up_its_partition(kafka: KafkaSettings) -> None:
    partitions = Topics(kafka).specs["tasks"].partitions
    slow, *quick = ids_on_partition(0, partitions, 11, f"hol-{kafka.topic_prefix}")
    await queue(kafka, [{"rollout_id": slow, "stall": 120}])
    await queue(kafka, [{"rollout_id": q, "spans": 1} for q in quick])
    async with runner_in_process(kafka, concurrency=4):
        started = time.monotonic()
        await wait_terminal(kafka, quick, 30)
        assert time.monotonic() - started < 30
        h = await history(kafka, with_spans=False)
        assert h.final(slow) is None  # still running behind them
        await cancel(kafka, slow)
        h = await wait_terminal(kafka, [slow], 30)
    assert h.final(slow).status == RolloutStatus.CANCELLED  # type: ignore[union-attr]


async def cancel(kafka: KafkaSettings, rollout_id: str) -> None:
    async with producer(kafka) as prod:
        await EventPublisher(prod, Topics(kafka)).publish(
            "tasks", RolloutCancelled(rollout_id=rollout_id, reason="test", requested_by="pytest")
        )


async def test_timeout_fails_the_attempt(kafka: KafkaSettings) -> None:
    ids = await queue(kafka, [{"stall": 60, "spans": 1}], timeout_seconds=1.0)
    async with runner_in_process(kafka):
        h = await wait_terminal(kafka, ids, 30)
    (attempt,) = h.finished[ids[0]]
    assert attempt.status == AttemptStatus.TIMEOUT
    assert "timeout of 1 s" in attempt.error.message  # type: ignore[union-attr]
    assert h.final(ids[0]).status == RolloutStatus.FAILED  # type: ignore[union-attr]
    assert sorted(s.sequence for s in h.spans[attempt.attempt_id]) == list(
        range(attempt.span_count)
    )


async def test_retry_after_failure_then_success(kafka: KafkaSettings) -> None:
    ids = await queue(
        kafka, [{"fail_on_attempts": [1]}], max_attempts=3, retry_condition=(AttemptStatus.FAILED,)
    )
    async with runner_in_process(kafka):
        h = await wait_terminal(kafka, ids, 30)
    attempts = sorted(h.finished[ids[0]], key=lambda a: a.attempt_number)
    assert [(a.attempt_number, a.status) for a in attempts] == [
        (1, AttemptStatus.FAILED),
        (2, AttemptStatus.SUCCEEDED),
    ]
    assert "told to fail attempt 1" in attempts[0].error.message  # type: ignore[union-attr]
    requeued = [q for q in h.queued[ids[0]] if q.attempt_number == 2]
    assert requeued and requeued[0].previous_attempt_id == attempts[0].attempt_id
    final = h.final(ids[0])
    assert final is not None and final.status == RolloutStatus.SUCCEEDED
    assert final.attempt_id == attempts[1].attempt_id and final.attempt_count == 2


async def test_retry_exhaustion_fails_the_rollout(kafka: KafkaSettings) -> None:
    ids = await queue(
        kafka,
        [{"fail_on_attempts": [1, 2]}],
        max_attempts=2,
        retry_condition=(AttemptStatus.FAILED,),
    )
    async with runner_in_process(kafka):
        h = await wait_terminal(kafka, ids, 30)
    assert [a.status for a in h.finished[ids[0]]] == [AttemptStatus.FAILED] * 2
    final = h.final(ids[0])
    assert final is not None and final.status == RolloutStatus.FAILED
    assert final.error is not None and "told to fail attempt 2" in final.error.message


async def test_unresponsive_attempt_is_retried_by_policy(kafka: KafkaSettings) -> None:
    ids = await queue(
        kafka, [{"stall": 60, "spans": 1}], unresponsive_seconds=1.0, max_attempts=2,
        retry_condition=(AttemptStatus.UNRESPONSIVE,),
    )  # fmt: skip
    async with runner_in_process(kafka):
        h = await wait_terminal(kafka, ids, 30)
    assert [a.status for a in h.finished[ids[0]]] == [AttemptStatus.UNRESPONSIVE] * 2
    assert h.final(ids[0]).status == RolloutStatus.FAILED  # type: ignore[union-attr]


async def test_cancel_running_and_queued_rollouts(kafka: KafkaSettings) -> None:
    before = await queue(kafka, [{"spans": 1}])
    await cancel(kafka, before[0])  # cancelled before any runner saw it: never runs
    running = await queue(kafka, [{"stall": 60, "spans": 1}])
    async with runner_in_process(kafka):
        await eventually(lambda: _started(kafka, running[0]), 30, "the attempt to start")
        await cancel(kafka, running[0])
        h = await wait_terminal(kafka, before + running, 30)
    assert h.final(before[0]).status == RolloutStatus.CANCELLED  # type: ignore[union-attr]
    assert h.finished[before[0]] == []
    assert h.final(running[0]).status == RolloutStatus.CANCELLED  # type: ignore[union-attr]
    (attempt,) = h.finished[running[0]]
    assert attempt.error is not None and "test by pytest" in attempt.error.message


async def _started(kafka: KafkaSettings, rollout_id: str) -> bool:
    return bool((await history(kafka, with_spans=False)).started.get(rollout_id))


async def test_bad_tasks_never_stop_a_runner(kafka: KafkaSettings) -> None:
    topics = Topics(kafka)
    async with producer(kafka) as prod:
        await prod.send_and_wait(topics.name("tasks"), os.urandom(40), key=b"junk")
    rejected = await queue(kafka, [{"reject": True}])
    async with runner_in_process(kafka):
        good = await queue(kafka, [{"spans": 1} for _ in range(5)])
        h = await wait_terminal(kafka, rejected + good, 30)
    assert h.final(rejected[0]).status == RolloutStatus.FAILED  # type: ignore[union-attr]
    assert h.finished[rejected[0]][0].error.type == "TypeError"  # type: ignore[union-attr]
    assert all(h.final(g).status == RolloutStatus.SUCCEEDED for g in good)  # type: ignore[union-attr]
    letters = await read_dead_letters(kafka, 10)
    assert [x.kind for x in letters] == ["not_single_object"]


async def test_agents_get_the_latest_or_pinned_resources(kafka: KafkaSettings) -> None:
    async with producer(kafka) as prod:
        publisher = EventPublisher(prod, Topics(kafka))
        for version in (1, 2):
            await publisher.publish(
                "resources",
                ResourcesPublished(
                    resources_id=f"res-{version}", version=version,
                    resources={"prompt": PromptTemplate(template=f"template v{version}")},
                ),
            )  # fmt: skip
    latest = await queue(kafka, [{}])
    pinned = await queue(kafka, [{}], resources_id="res-1")
    unknown = await queue(kafka, [{}], resources_id="res-404")
    async with runner_in_process(kafka, agent="tests.support.agents:Prompted"):
        h = await wait_terminal(kafka, latest + pinned + unknown, 30)
    for rollout_id, expected in ((latest[0], "res-2"), (pinned[0], "res-1")):
        (started,) = h.started[rollout_id]
        assert started.resources_id == expected
        (attempt,) = h.finished[rollout_id]
        message = next(s for s in h.spans[attempt.attempt_id] if s.name == "agl.message")
        assert message.attributes["agl.message"] == f"template v{expected[-1]}"
    (attempt,) = h.finished[unknown[0]]
    assert attempt.error is not None and attempt.error.type == "UnknownResources"


async def test_sync_agents_and_reward_dimensions(kafka: KafkaSettings) -> None:
    ids = await queue(kafka, [{"sleep": 0.1}] * 3)
    async with runner_in_process(kafka, agent="tests.support.agents:sync_agent"):
        h = await wait_terminal(kafka, ids, 30)
    for rollout_id in ids:
        assert_complete(h, rollout_id)
        (attempt,) = h.finished[rollout_id]
        assert attempt.reward == 0.5
        reward = next(s for s in h.spans[attempt.attempt_id] if s.name == "agl.reward")
        assert reward.attributes["agl.reward.length"] == 1.0


async def test_heartbeats_report_the_runner(kafka: KafkaSettings) -> None:
    from aiokafka import TopicPartition

    from agl_stream.bus.streams import read_partitions
    from agl_stream.events import WorkerHeartbeat, WorkerStatus

    async with runner_in_process(kafka, worker_id="hb-runner"):
        await asyncio.sleep(2.5)
    beats = [
        e for e in await read_partitions(kafka, [TopicPartition(kafka.topic("workers"), 0)])
        if isinstance(e, WorkerHeartbeat)
    ]  # fmt: skip
    statuses = [b.status for b in beats if b.worker_id == "hb-runner"]
    assert statuses[0] == WorkerStatus.STARTING
    assert statuses[-1] == WorkerStatus.STOPPED
    assert WorkerStatus.IDLE in statuses


async def test_a_resources_follower_that_fails_before_loading_is_started_again(
    kafka: KafkaSettings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """It used to leave the runner waiting for the first load forever, without a word."""
    real = worker.follow_resources
    failures = 0

    async def flaky(*args: Any, **kwargs: Any) -> None:
        nonlocal failures
        if failures < 2:
            failures += 1
            raise KafkaConnectionError(f"no broker ({failures})")
        await real(*args, **kwargs)

    monkeypatch.setattr(worker, "follow_resources", flaky)
    ids = await queue(kafka, [{"spans": 1} for _ in range(3)])
    with caplog.at_level(logging.WARNING, logger="agl_stream.runtime.supervision"):
        async with runner_in_process(kafka):
            h = await wait_terminal(kafka, ids, 60)
    assert all(h.final(r).status == RolloutStatus.SUCCEEDED for r in ids)  # type: ignore[union-attr]
    failed = [
        r.getMessage() for r in caplog.records if "resources follower failed" in r.getMessage()
    ]
    assert len(failed) == 2, failed


async def test_the_ledger_does_not_grow_with_the_rollouts_run(kafka: KafkaSettings) -> None:
    """It kept every rollout it ever saw (not even pruned on hand-back)."""
    async with runner_in_process(kafka, concurrency=16) as runner:
        for _ in range(3):
            ids = await queue(kafka, [{"spans": 0} for _ in range(100)])
            await wait_terminal(kafka, ids, 60)

        async def pruned() -> bool:
            return runner._counts()["ledger_rollouts"] == 0

        await eventually(pruned, 10, "the runner to forget the finished rollouts")
    assert runner.counts["ledger_pruned"] >= 300


async def test_a_record_the_runner_fails_to_record_ends_failed_and_releases_the_commit(
    kafka: KafkaSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job that failed in the runner itself left its offset uncommitted (and the rollout
    unfinished) until the next rebalance, holding back every later commit."""
    real = worker.execute

    async def buggy(agent: Any, task: Any, *args: Any, **kwargs: Any) -> Any:
        if "boom" in task.input_json:
            raise RuntimeError("a bug in the runner")
        return await real(agent, task, *args, **kwargs)

    monkeypatch.setattr(worker, "execute", buggy)
    topics = Topics(kafka)
    partitions = topics.specs["tasks"].partitions
    boom = ids_on_partition(0, partitions, 1, f"boom-{os.getpid()}")
    ok = ids_on_partition(0, partitions, 5, f"ok-{os.getpid()}")
    ids = await queue(kafka, [{"spans": 0, "boom": 1, "rollout_id": boom[0]}])
    ids += await queue(kafka, [{"spans": 0, "rollout_id": r} for r in ok])
    async with runner_in_process(kafka, commit_seconds=0.1) as runner:
        h = await wait_terminal(kafka, ids, 60)
        tasks0 = TopicPartition(topics.name("tasks"), 0)
        end = (await end_offsets(kafka, [tasks0]))[tasks0]

        async def committed_to_the_end() -> bool:
            async with admin_client(kafka) as admin:
                offset, _ = await committed_checkpoint(admin, runner.group_id, tasks0)
            return offset == end

        await eventually(committed_to_the_end, 20, "the commit to pass the failed record")
    final = h.final(boom[0])
    assert final is not None and final.status == RolloutStatus.FAILED
    assert final.error is not None and final.error.type == "RunnerError"
    assert "a bug in the runner" in final.error.message
    # The attempt it had started ends too (no attempt is left running for ever).
    [started] = h.started[boom[0]]
    [attempt] = h.finished[boom[0]]
    assert attempt.attempt_id == started.attempt_id == final.attempt_id
    assert attempt.status == AttemptStatus.FAILED and attempt.error == final.error
    assert all(h.final(r).status == RolloutStatus.SUCCEEDED for r in ok)  # type: ignore[union-attr]
