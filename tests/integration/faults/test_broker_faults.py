"""The broker's disk filled while tasks are queued, then freed: Kafka stops the broker when its
only log directory fails; the writer gets an error that says so within two request timeouts
(an idempotent producer retries without end, and used to hang); once the space is back and
the broker started again (as an operator, or a pod's restart, does), every acknowledged task
is on the topic and in the read model (within the transaction timeout: a transaction the
halted broker left open holds readers back until it is aborted), nothing is half-written (no
dead letter, the read model equals a replay), and queueing goes on. A private embedded stack
whose Kafka node logs to a small tmpfs of its own (root only)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaConnectionError

from agl_stream.bus.kafka import acknowledgement_seconds, end_offsets
from agl_stream.bus.streams import DLQ_TOPIC, Topics
from agl_stream.bus.topic_admin import apply_topics
from agl_stream.commands.enqueue import enqueue
from agl_stream.db.migrate import migrate
from agl_stream.queries import ReadModel
from tests.support.broker_faults import SmallDiskStack
from tests.support.helpers import eventually, traversable
from tests.support.postgres_faults import DiskUnavailable
from tests.support.projection import assert_equals_replay, caught_up, dump, ends, projector_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DISK_MB = 48
# The writer's transactions time out after 5 s, not enqueue's 30 s (each takes a fraction of
# a second here): the one the halt leaves open has timed out before the broker serves again
# (a restart takes 10 s or more), so the broker aborts it about a second after it is back
# (its check runs every second here: broker_faults.FAST_RECOVERY) instead of up to 40 s
# after it began.
TRANSACTION_TIMEOUT_MS = 5_000


def tasks(first: int, count: int) -> list[dict[str, object]]:
    # Padding that does not compress: the disk fills after a few dozen batches.
    return [{"n": first + i, "pad": os.urandom(1500).hex()} for i in range(count)]


async def test_broker_disk_full_then_freed(tmp_path: Path) -> None:
    stack = SmallDiskStack(traversable(tmp_path / "stack"), DISK_MB)
    projector = None
    try:
        try:
            await asyncio.to_thread(stack.up)
        except DiskUnavailable as exc:
            pytest.skip(f"no small disk for the broker here ({exc}): run as root")
        kafka, database = stack.settings(request_timeout_ms=5_000)
        await apply_topics(kafka)
        await migrate(database)
        acked: dict[str, int] = {}

        async def queued(first: int, count: int) -> None:
            # Keyed, in a transaction, as `agl-stream enqueue` queues.
            batch = tasks(first, count)
            queueing = enqueue(
                kafka, batch, key=f"batch-{first}", transaction_timeout_ms=TRANSACTION_TIMEOUT_MS
            )
            ids = await asyncio.wait_for(queueing, 60)
            acked.update({rid: first + i for i, rid in enumerate(ids)})

        await queued(0, 20)
        stack.fill(leave_bytes=512 * 1024)
        refused: list[BaseException] = []
        n = 20
        deadline = time.monotonic() + 120
        while not refused and time.monotonic() < deadline:
            began = time.monotonic()
            try:
                await queued(n, 10)
            except KafkaConnectionError as exc:  # a sentence, in bounded time: never a hang
                refused.append(exc)
                waited = time.monotonic() - began
                assert waited < acknowledgement_seconds(kafka) + 10, waited
            n += 10
        assert refused, f"the broker took {len(acked)} tasks on a full disk"

        async def broker_stopped() -> bool:
            return not stack.broker_running()

        await eventually(broker_stopped, 60, "Kafka to stop the broker whose log dir failed")
        with pytest.raises(KafkaConnectionError):
            await queued(n, 1)
        stack.free()
        await asyncio.to_thread(stack.up)  # the broker again, recovering its log
        await queued(10_000, 20)
        projector = await projector_process(kafka, database, "after")
        missing: list[str] = list(acked)

        async def all_there() -> bool:
            # A transaction the halted broker left open holds read_committed readers below it
            # (the last stable offset) until its coordinator aborts it: the transaction
            # timeout and a check for timed-out ones (here the abort comes as the broker is
            # back: TRANSACTION_TIMEOUT_MS). What is committed above it waits until then.
            nonlocal missing
            async with ReadModel.open(database) as model:
                found = await model.rollouts_by_id(missing)
            missing = [rid for rid in missing if rid not in found]
            return not missing

        await eventually(all_there, 150, "every acknowledged task in the read model")
        final = await ends(kafka)
        await eventually(lambda: caught_up(database, final), 120, "the projector to catch up")
        live = await dump(database)
        wrong = [rid for rid, i in acked.items() if live[rid]["rollout"]["input"]["n"] != i]
        assert not wrong, wrong[:5]
        topics = Topics(kafka)
        dlq = [
            TopicPartition(topics.name(DLQ_TOPIC), p)
            for p in range(topics.specs[DLQ_TOPIC].partitions)
        ]
        letters = await end_offsets(kafka, dlq)
        assert sum(letters.values()) == 0, "a record was half-written: it went to the dead letters"
        # Stopped first: its heartbeats would move the read model between the two reads the
        # replay check makes (the read model, then where it stands).
        projector.send_signal(signal.SIGTERM)
        await asyncio.wait_for(projector.wait(), 60)
        await assert_equals_replay(kafka, database)
        print(
            f"\nthe broker's disk full: {len(acked)} tasks acknowledged, all there; the writer "
            f"saw {type(refused[0]).__name__}: {refused[0]}"
        )
    finally:
        if projector is not None and projector.returncode is None:
            projector.send_signal(signal.SIGTERM)
            await asyncio.wait_for(projector.wait(), 60)
        await asyncio.to_thread(stack.down)
