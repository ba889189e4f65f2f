"""`agl-stream cancel` through the real broker, read model, projector and runner: by filter
before a runner reads the rollouts, by id while one runs, ids never queued refused; a runner
with every slot busy still reads cancels."""

from __future__ import annotations

from aiokafka import TopicPartition

from agl_stream.bus.streams import Topics, read_partitions
from agl_stream.commands.cancel import cancel
from agl_stream.events import RolloutCancelled, RolloutStatus
from agl_stream.queries import ReadModel
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings
from tests.support.helpers import eventually, invoke_cli
from tests.support.projection import projector_in_process
from tests.support.runs import history, queue, runner_in_process, wait_terminal


async def _started(kafka: KafkaSettings, rollout_id: str) -> bool:
    return bool((await history(kafka, with_spans=False)).started.get(rollout_id))


async def _projected(database: DatabaseSettings, rollout_ids: list[str]) -> bool:
    async with ReadModel.open(database) as rm:
        return len(await rm.rollouts_by_id(rollout_ids)) == len(rollout_ids)


async def _cancels(kafka: KafkaSettings) -> list[RolloutCancelled]:
    topics = Topics(kafka)
    tasks = [
        TopicPartition(topics.name("tasks"), p) for p in range(topics.specs["tasks"].partitions)
    ]
    return [e for e in await read_partitions(kafka, tasks) if isinstance(e, RolloutCancelled)]


async def test_cancel_by_filter_and_by_id_through_the_cli(
    kafka: KafkaSettings, database: DatabaseSettings
) -> None:
    cli = (
        "--bootstrap-servers", kafka.bootstrap_servers, "--topic-prefix", kafka.topic_prefix,
        "--database-url", database.database_url.get_secret_value(), "cancel",
    )  # fmt: skip
    async with projector_in_process(kafka, database):
        doomed = await queue(kafka, [{"spans": 1}] * 2, metadata={"batch": "doomed"})
        kept = await queue(kafka, [{"spans": 1, "sleep": 0.2}] * 3, metadata={"batch": "kept"})
        victim = await queue(kafka, [{"stall": 60, "spans": 1}], metadata={"batch": "victim"})
        everything = doomed + kept + victim
        await eventually(lambda: _projected(database, everything), 30, "the rollouts projected")

        refused = await invoke_cli(*cli, doomed[0], "ro-never-queued")
        assert refused.exit_code == 1, refused.output
        assert "no rollout 'ro-never-queued'" in refused.output
        dry = await invoke_cli(*cli, "--metadata", "batch=doomed", "--dry-run")
        assert dry.exit_code == 0, dry.output
        assert "would cancel (2)" in dry.output
        dry = await invoke_cli(*cli, "--metadata", "batch=doomed", "--dry-run", "--print-ids")
        assert dry.exit_code == 0 and dry.stdout.split() == sorted(doomed), dry.output
        assert await _cancels(kafka) == []  # neither the refusal nor the dry run sent one

        # No runner has read them yet: they end without running.
        by_filter = await invoke_cli(
            *cli, "--metadata", "batch=doomed", "--reason", "bad batch", "--requested-by", "me"
        )
        assert by_filter.exit_code == 0, by_filter.output
        assert "asked to cancel 2 rollouts" in by_filter.output
        async with runner_in_process(kafka):  # 16 slots: never full here
            await eventually(lambda: _started(kafka, victim[0]), 30, "the victim to start")
            by_id = await invoke_cli(*cli, victim[0], "--reason", "too slow", "--print-ids")
            assert by_id.exit_code == 0, by_id.output
            assert by_id.stdout.split() == victim
            h = await wait_terminal(kafka, everything, 60)
        async with ReadModel.open(database) as rm:
            statuses = await rm.wait_for_rollouts(everything, within=30)
            again = await invoke_cli(*cli, *doomed)
    for rollout_id in doomed:
        final = h.final(rollout_id)
        assert final is not None and final.status == RolloutStatus.CANCELLED
        assert final.error is not None and final.error.message == "bad batch by me"
        assert h.started[rollout_id] == []
    final = h.final(victim[0])
    assert final is not None and final.status == RolloutStatus.CANCELLED
    (attempt,) = h.finished[victim[0]]
    assert attempt.error is not None and attempt.error.message.startswith("too slow by ")
    for rollout_id in kept:
        assert h.final(rollout_id).status == RolloutStatus.SUCCEEDED  # type: ignore[union-attr]
    assert statuses == {
        **{i: "cancelled" for i in doomed + victim},
        **{i: "succeeded" for i in kept},
    }
    assert sorted(c.rollout_id for c in await _cancels(kafka)) == sorted(doomed + victim)
    assert again.exit_code == 0 and "nothing to cancel" in again.output


async def test_a_runner_with_every_slot_busy_still_reads_cancels(kafka: KafkaSettings) -> None:
    """Issue 18: a runner with every slot busy pauses its partitions, so its consumer reads
    no cancel until a slot frees; the cancel watch reads them anyway. (Before it, the
    running rollout ran to its end and the waiting one started before its cancel was read.)"""
    busy = await queue(kafka, [{"sleep": 5, "spans": 2}])
    async with runner_in_process(kafka, concurrency=1):
        await eventually(lambda: _started(kafka, busy[0]), 30, "the first rollout to start")
        waiting = await queue(kafka, [{"spans": 1}])
        await cancel(kafka, busy + waiting, reason="stop", requested_by="pytest")
        h = await wait_terminal(kafka, busy + waiting, 60)
    assert [h.final(i).status for i in busy + waiting] == [RolloutStatus.CANCELLED] * 2  # type: ignore[union-attr]


async def test_requeue_through_the_cli(kafka: KafkaSettings, database: DatabaseSettings) -> None:
    cli = (
        "--bootstrap-servers", kafka.bootstrap_servers, "--topic-prefix", kafka.topic_prefix,
        "--database-url", database.database_url.get_secret_value(), "requeue",
    )  # fmt: skip
    async with projector_in_process(kafka, database), runner_in_process(kafka):
        done = await queue(kafka, [{"reward": 0.5}, {"fail_on_attempts": [1]}], mode="val")
        (busy,) = await queue(kafka, [{"stall": 60, "spans": 1}])
        async with ReadModel.open(database) as rm:
            await rm.wait_for_rollouts(done, within=60)
        await eventually(lambda: _projected(database, [busy]), 30, "the stalled one projected")

        refused = await invoke_cli(*cli, done[0], "ro-never-queued")
        assert refused.exit_code == 1 and "no rollout 'ro-never-queued'" in refused.output
        refused = await invoke_cli(*cli, busy)
        assert refused.exit_code == 2 and "only finished rollouts can be requeued" in refused.output
        first = await invoke_cli(*cli, *done)
        assert first.exit_code == 0, first.output
        copies = dict(line.split(" -> ") for line in first.stdout.splitlines())
        assert list(copies) == done and not set(copies.values()) & set(done)
        again = await invoke_cli(*cli, *done)
        assert again.stdout == first.stdout  # no second copy
        async with ReadModel.open(database) as rm:
            await rm.wait_for_rollouts(list(copies.values()), within=60)
            found = await rm.rollouts_by_id(copies.values())
            for original, copy in copies.items():
                assert found[copy].metadata == {"requeued_from": original}
                assert found[copy].mode == "val"
            assert found[copies[done[0]]].status == "succeeded"
            assert found[copies[done[1]]].status == "failed"
        await cancel(kafka, [busy])
