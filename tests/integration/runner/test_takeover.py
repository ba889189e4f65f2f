"""Taking over a partition: what already finished is never run again, a runner cut off from
its group cannot publish after the takeover (fenced), and the takeover reads only what the
partition's unfinished records rely on, not its history."""

from __future__ import annotations

import asyncio
import signal
import uuid
from typing import Any

import pytest
from aiokafka import TopicPartition

from agl_stream.bus.codec import Codec
from agl_stream.bus.kafka import producer
from agl_stream.bus.streams import EventPublisher, Topics
from agl_stream.commands.enqueue import RolloutOptions, enqueue, make_rollout
from agl_stream.events import (
    AttemptFinished,
    AttemptStarted,
    AttemptStatus,
    RolloutFinished,
    RolloutStatus,
)
from agl_stream.runner import worker
from agl_stream.runtime.config import KafkaSettings
from tests.support.helpers import eventually
from tests.support.runs import (
    history,
    ids_on_partition,
    runner_in_process,
    runner_process,
    wait_terminal,
)

pytestmark = pytest.mark.slow


async def _left_by_a_victim(kafka: KafkaSettings, ids: list[str]) -> dict[str, str]:
    """What a runner killed right after a burst leaves: the tasks queued and not committed,
    each attempt started; half of them also succeeded, with the rollout's end (committed
    together), the other half were cut off mid-attempt. Returns rollout id -> attempt id."""
    topics = Topics(kafka)
    attempts = {rollout_id: uuid.uuid4().hex for rollout_id in ids}
    await enqueue(kafka, [{"spans": 0, "rollout_id": r} for r in ids], RolloutOptions())
    async with producer(kafka) as prod:
        publisher = EventPublisher(prod, topics)
        for i, rollout_id in enumerate(ids):
            common: dict[str, Any] = {
                "rollout_id": rollout_id,
                "attempt_id": attempts[rollout_id],
                "attempt_number": 1,
                "worker_id": "victim",
            }
            lifecycle: list[Any] = [AttemptStarted(**common, task_offset=i)]
            if i % 2 == 0:
                lifecycle += [
                    AttemptFinished(
                        **common, status=AttemptStatus.SUCCEEDED, span_count=0, reward=1
                    ),
                    RolloutFinished(
                        rollout_id=rollout_id,
                        status=RolloutStatus.SUCCEEDED,
                        attempt_id=attempts[rollout_id],
                        attempt_count=1,
                    ),
                ]
            await publisher.publish_many("rollouts", lifecycle)
    return attempts


@pytest.mark.parametrize("fold_delay", [0.0, 1.5])
async def test_a_new_owner_never_runs_again_what_finished_above_the_commit(
    kafka: KafkaSettings, monkeypatch: pytest.MonkeyPatch, fold_delay: float
) -> None:
    """The kill-right-after-a-burst bug: the new owner's consumer hands it records while it
    is still folding the rollouts partition; it must not plan them from an empty ledger.
    A slow fold (fold_delay) shows the order is enforced, not won by timing."""
    partitions = Topics(kafka).specs["tasks"].partitions
    ids = ids_on_partition(0, partitions, 20, f"burst-{uuid.uuid4().hex[:6]}")
    attempts = await _left_by_a_victim(kafka, ids)
    real_fold = worker.read_partition_with

    async def slow_fold(*args: Any) -> Any:
        await asyncio.sleep(fold_delay)
        return await real_fold(*args)

    monkeypatch.setattr(worker, "read_partition_with", slow_fold)
    async with runner_in_process(kafka) as runner:
        h = await wait_terminal(kafka, ids, 60)
    for i, rollout_id in enumerate(ids):
        finished = h.finished[rollout_id]
        final = h.final(rollout_id)
        assert final is not None and final.status == RolloutStatus.SUCCEEDED
        assert len(finished) == 1 and final.attempt_id == finished[0].attempt_id
        if i % 2 == 0:  # finished by the victim: not run again
            assert [s.worker_id for s in h.started[rollout_id]] == ["victim"], rollout_id
            assert finished[0].attempt_id == attempts[rollout_id]
        else:  # cut off: run again, once
            workers = [s.worker_id for s in h.started[rollout_id]]
            assert len(workers) == 2 and workers[0] == "victim", workers
            assert finished[0].worker_id != "victim"
    assert runner.counts["skipped"] == len(ids) // 2  # the finished ones
    assert runner.counts["attempts_succeeded"] == len(ids) // 2  # the cut-off ones, once


async def test_an_attempt_found_ended_is_not_retried_a_second_time(
    kafka: KafkaSettings,
) -> None:
    """A victim ran attempt 1 of each rollout, which failed; it committed the attempt's end
    and the retry record (attempt 2) together, then died before committing its offset. The
    new owner meets the attempt-1 record first, with the end folded but the retry record
    not read yet: it must not queue a second retry. (It did: after one more takeover whose
    fold began past the rollout's end, that second retry record ran the rollout to success
    a second time: the chaos test's double success under broker kills.)"""
    topics = Topics(kafka)
    partitions = topics.specs["tasks"].partitions
    ids = ids_on_partition(0, partitions, 10, f"retried-{uuid.uuid4().hex[:6]}")
    options = RolloutOptions(max_attempts=2, retry_condition=(AttemptStatus.FAILED,))
    await enqueue(kafka, [{"spans": 0, "rollout_id": r} for r in ids], options)
    async with producer(kafka) as prod:
        publisher = EventPublisher(prod, topics)
        for i, rollout_id in enumerate(ids):
            first = make_rollout({"spans": 0}, options, rollout_id)
            common: dict[str, Any] = {
                "rollout_id": rollout_id, "attempt_id": f"victim-{i}", "attempt_number": 1,
                "worker_id": "victim",
            }  # fmt: skip
            await publisher.publish_many(
                "rollouts",
                [
                    AttemptStarted(**common, task_offset=i),
                    AttemptFinished(**common, status=AttemptStatus.FAILED, span_count=0),
                ],
            )
            retry = first.model_copy(
                update={"attempt_number": 2, "previous_attempt_id": f"victim-{i}"}
            )
            await publisher.publish("tasks", retry)
    async with runner_in_process(kafka) as runner:
        h = await wait_terminal(kafka, ids, 60)
    for rollout_id in ids:
        assert [q.attempt_number for q in h.queued[rollout_id]] == [1, 2], rollout_id
        succeeded = [f for f in h.finished[rollout_id] if f.status == AttemptStatus.SUCCEEDED]
        assert [f.attempt_number for f in succeeded] == [2]
        assert len(h.ended[rollout_id]) == 1
    assert runner.counts["requeued"] == 0


async def test_a_runner_frozen_past_its_session_cannot_publish_after_the_takeover(
    kafka: KafkaSettings,
) -> None:
    """SIGSTOP a runner mid-attempt until the group gives its partitions to another, then
    SIGCONT it: its attempts end, but the new owner's lane fenced it, so the only succeeded
    attempt of each rollout on the topics is the new owner's."""
    tasks = [{"spans": 4, "sleep": 4.0, "reward": 1.0} for _ in range(24)]
    zombie = await runner_process(kafka, "zombie", concurrency=32)
    survivor = None
    try:
        ids = await enqueue(kafka, tasks, RolloutOptions())

        async def all_started() -> bool:
            return len((await history(kafka, with_spans=False)).started) == len(ids)

        # Nothing is visible before the zombie's lanes commit their first transactions.
        await eventually(all_started, 60, "the zombie to start every rollout")
        zombie.send_signal(signal.SIGSTOP)
        survivor = await runner_process(kafka, "survivor", concurrency=32)
        h = await wait_terminal(kafka, ids, 90)
        zombie.send_signal(signal.SIGCONT)
        await asyncio.sleep(6)  # the zombie's attempts end now; it tries to publish them
        h = await history(kafka)
    finally:
        zombie.send_signal(signal.SIGCONT)
        for process in (zombie, survivor):
            if process is not None and process.returncode is None:
                process.send_signal(signal.SIGTERM)
        for process in (zombie, survivor):
            if process is not None:
                await asyncio.wait_for(process.wait(), 60)
    for rollout_id in ids:
        succeeded = [f for f in h.finished[rollout_id] if f.status == AttemptStatus.SUCCEEDED]
        assert [f.worker_id for f in succeeded] == ["survivor"], (rollout_id, succeeded)
        assert [e.attempt_id for e in h.ended[rollout_id]] == [succeeded[0].attempt_id]
    assert zombie.returncode == 0 and survivor is not None and survivor.returncode == 0


async def test_takeover_reads_what_unfinished_records_rely_on_not_the_history(
    kafka: KafkaSettings,
) -> None:
    """A partition with a long history: after a runner worked through it and stopped, the
    next owner's fold starts where the committed offset says, not at offset 0."""
    topics = Topics(kafka)
    old = 20_000
    rollouts = TopicPartition(topics.name("rollouts"), 0)
    codec = Codec()
    async with producer(kafka, linger_ms=50, max_batch_size=1 << 20) as prod:
        # History: finished rollouts of long ago, on partition 0 of the rollouts topic.
        futures = []
        for i in range(old):
            rollout_id = f"old-{i}"
            finished = RolloutFinished(
                rollout_id=rollout_id, status=RolloutStatus.SUCCEEDED, attempt_count=1
            )
            futures.append(
                await prod.send(
                    rollouts.topic,
                    codec.encode(finished),
                    key=rollout_id.encode(),
                    partition=0,
                )
            )
        await asyncio.gather(*futures)
    partitions = topics.specs["tasks"].partitions
    ids = ids_on_partition(0, partitions, 10, f"new-{uuid.uuid4().hex[:6]}")
    await enqueue(kafka, [{"spans": 1, "rollout_id": r} for r in ids], RolloutOptions())
    async with runner_in_process(kafka) as first:
        await wait_terminal(kafka, ids, 60)
    assert first.counts["takeover_records_read"] >= old  # no checkpoint yet: from offset 0
    more = ids_on_partition(0, partitions, 10, f"more-{uuid.uuid4().hex[:6]}")
    await enqueue(kafka, [{"spans": 1, "rollout_id": r} for r in more], RolloutOptions())
    async with runner_in_process(kafka) as second:
        h = await wait_terminal(kafka, more, 60)
    # The second owner read the rollouts partition only from the first one's checkpoint:
    # none of the history, at most what the first owner wrote after it.
    assert second.counts["takeover_records_read"] < 100, second.counts
    assert all(len(h.started[r]) == 1 for r in more)
