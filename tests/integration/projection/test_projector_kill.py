"""Kill -9 the projector at random points while events flow: after it catches up, the read
model equals, row for row through the query API, a replay of the same topics into an empty
read model. Also when every event is delivered twice."""

from __future__ import annotations

import asyncio
import random
import signal

import pytest

from agl_stream.bus.topic_admin import apply_topics
from agl_stream.projection.replay import replay
from agl_stream.queries import ReadModel
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings
from tests.support.helpers import eventually
from tests.support.projection import (
    assert_equals_replay,
    caught_up,
    dump,
    ends,
    projector_process,
    publish_slowly,
)
from tests.support.traffic import Traffic, traffic

pytestmark = pytest.mark.slow


async def kill_repeatedly(
    kafka: KafkaSettings, database: DatabaseSettings, sent: Traffic, kills: int, seed: int
) -> None:
    rng = random.Random(seed)
    publishing = asyncio.create_task(publish_slowly(kafka, sent))
    for i in range(kills):
        process = await projector_process(kafka, database, f"victim-{i}", batch_size=200)
        await asyncio.sleep(rng.uniform(2.0, 5.0))
        if process.returncode is not None:
            assert process.stderr is not None
            pytest.fail(f"the projector died by itself: {(await process.stderr.read()).decode()}")
        process.send_signal(signal.SIGKILL)
        await process.wait()
    await publishing
    survivor = await projector_process(kafka, database, "survivor", batch_size=200)
    try:
        final = await ends(kafka)
        await eventually(lambda: caught_up(database, final), 180, "the projector to catch up")
    finally:
        survivor.send_signal(signal.SIGTERM)
        await asyncio.wait_for(survivor.wait(), 60)


async def test_kill_9_many_times_then_equal_to_a_replay(
    kafka: KafkaSettings, database: DatabaseSettings
) -> None:
    sent = traffic(seed=11, rollouts=400)
    await kill_repeatedly(kafka, database, sent, kills=5, seed=1)
    await assert_equals_replay(kafka, database)
    live = await dump(database)
    assert len([k for k in live if k.startswith("ro-")]) == 400


async def test_every_event_delivered_twice(
    kafka: KafkaSettings, database: DatabaseSettings
) -> None:
    once = traffic(seed=12, rollouts=200)
    rng = random.Random(5)
    twice = once + once
    # The second copy comes later, in another order (another process re-sending).
    second = twice[len(once) :]
    rng.shuffle(second)
    await kill_repeatedly(kafka, database, once + second, kills=3, seed=2)
    await assert_equals_replay(kafka, database)
    # And the same as if each event had come once.
    single = kafka.model_copy(update={"topic_prefix": f"{kafka.topic_prefix}once."})
    await apply_topics(single)
    await publish_slowly(single, once, chunk=1000)
    await replay(single, database, name="once", switch=False)
    twice_seen, once_seen = await dump(database), await dump(database, "once")
    twice_seen.pop("workers")
    once_seen.pop("workers")  # the projectors' own heartbeats differ
    assert twice_seen == once_seen


async def test_two_projectors_share_the_work_and_survive_a_kill(
    kafka: KafkaSettings, database: DatabaseSettings
) -> None:
    sent = traffic(seed=13, rollouts=200)
    # Slowly enough (~17 s) that both are in the group while records still arrive: one that
    # joins after the other has drained every partition would have nothing to do.
    publishing = asyncio.create_task(publish_slowly(kafka, sent, chunk=40, pause=0.5))
    pair = [await projector_process(kafka, database, f"pair-{i}", batch_size=200) for i in range(2)]

    async def both_writing() -> bool:
        async with ReadModel.open(database) as rm:
            counts = {w.worker_id: w.counts.get("events", 0) for w in await rm.workers()}
        return counts.get("pair-0", 0) > 0 and counts.get("pair-1", 0) > 0

    try:
        await eventually(both_writing, 60, "both projectors to write a share")
        pair[0].send_signal(signal.SIGKILL)
        await pair[0].wait()
        await publishing
        final = await ends(kafka)
        await eventually(lambda: caught_up(database, final), 180, "the survivor to catch up")
    finally:
        if pair[1].returncode is None:
            pair[1].send_signal(signal.SIGTERM)
        await asyncio.wait_for(pair[1].wait(), 60)
    assert pair[1].returncode == 0
    async with ReadModel.open(database) as rm:
        projected = {w.worker_id: w.counts.get("events", 0) for w in await rm.workers()}
    # Both projected a share before the kill (heartbeats carry their counts).
    assert projected.get("pair-0", 0) > 0 and projected.get("pair-1", 0) > 0, projected
    await assert_equals_replay(kafka, database)
