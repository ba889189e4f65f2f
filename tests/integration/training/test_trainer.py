"""The trainer through the real broker on the CPU: runners run the demo agent on policy
versions the trainer publishes, and the trainer learns from what they did."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from aiokafka import TopicPartition

from agl_stream.bus.streams import read_partitions
from agl_stream.events import PromptTemplate, ResourcesPublished
from agl_stream.runtime.config import KafkaSettings
from agl_stream.training.checkpoints import CheckpointStore, checkpoint_root, lineage_problems
from agl_stream.training.model import content_hash, load_policy
from agl_stream.training.trainer import Trainer, TrainerConfig
from tests.support.helpers import eventually
from tests.support.runs import publish_resources, queue, runner_in_process

AGENT = "agl_stream.demo.task:echo_letter_in_process"


async def published(kafka: KafkaSettings) -> list[ResourcesPublished]:
    events = await read_partitions(kafka, [TopicPartition(kafka.topic("resources"), 0)])
    return [e for e in events if isinstance(e, ResourcesPublished)]


async def enqueue_group_tasks(kafka: KafkaSettings, version: str, groups: int, size: int) -> None:
    for g in range(groups):
        letter = "abcde"[g % 5]
        await queue(
            kafka, [{"letter": letter}] * size, resources_id=version,
            metadata={"group": f"{version}-{g}"},
        )  # fmt: skip


async def test_two_update_steps_through_the_broker(kafka: KafkaSettings, tmp_path: Path) -> None:
    config = TrainerConfig(
        checkpoint_dir=str(tmp_path / "checkpoints"), run_name="it", group_size=4,
        groups_per_step=2, max_steps=2, heartbeat_seconds=1.0,
    )  # fmt: skip
    trainer = Trainer(kafka, config)
    stop = asyncio.Event()
    training = asyncio.create_task(trainer.run(stop))
    async with runner_in_process(kafka, AGENT, concurrency=8):
        for version in range(2):
            resources_id = f"it-v{version}"

            async def out(rid: str = resources_id) -> bool:
                return any(e.resources_id == rid for e in await published(kafka))

            await eventually(out, 60, f"the trainer to publish {resources_id}")
            if version == 1:  # someone else (APO, say) publishes a prompt template meanwhile
                await publish_resources(
                    kafka, "prompt-v1", prompt=PromptTemplate(template="Say {letter}")
                )
            await enqueue_group_tasks(kafka, resources_id, groups=2, size=4)
        await asyncio.wait_for(training, 120)

    store = CheckpointStore(config.checkpoint_dir)
    assert store.steps() == [0, 1, 2]
    states = store.lineage()
    assert lineage_problems(states) == []
    assert [len(s["used"]) for s in states] == [0, 8, 8]
    assert (
        states[2]["counts"]["samples"] == 8
        and states[2]["counts"].get("calls_without_token_ids", 0) == 0
    )
    # Versions are numbered in the topic's order, whoever publishes: the prompt took 2.
    # Each of the trainer's points at its checkpoint, by a hash of the files there.
    topic = await published(kafka)
    assert [(e.resources_id, e.version) for e in topic] == [
        ("it-v0", 0), ("it-v1", 1), ("prompt-v1", 2), ("it-v3", 3),
    ]  # fmt: skip
    versions = {e.resources_id: e for e in topic}
    for step, rid in enumerate(("it-v0", "it-v1", "it-v3")):
        assert versions[rid].metadata["step"] == str(step)
        checkpoint = versions[rid].resources["policy"]
        directory = checkpoint_root(checkpoint.uri)  # type: ignore[union-attr]
        assert directory == store.step_dir(step)
        assert checkpoint.content_hash == content_hash(directory)  # type: ignore[union-attr]
    assert versions["it-v3"].parent_resources_id == "it-v1"
    # What another publisher set is carried by the trainer's next version, never lost.
    assert "prompt" not in versions["it-v1"].resources
    assert versions["prompt-v1"].resources["policy"] == versions["it-v1"].resources["policy"]
    assert versions["it-v3"].resources["prompt"] == PromptTemplate(template="Say {letter}")
    assert versions["it-v3"].metadata["samples"] == "8"
    # The update changed the weights.
    before = load_policy(store.step_dir(0)).model.state_dict()
    after = load_policy(store.step_dir(2)).model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)

    # Offline retrain of the same range into a fresh directory: the same attempts, in the
    # same number of steps, and nothing published.
    from agl_stream.training.retrain import resolve_range

    start, until = await resolve_range(kafka, {}, {})
    offline = TrainerConfig(
        checkpoint_dir=str(tmp_path / "retrain"), run_name="offline", group_size=4,
        groups_per_step=2, publish=False, start=start, until=until,
    )  # fmt: skip
    await asyncio.wait_for(Trainer(kafka, offline).run(asyncio.Event()), 120)
    again = CheckpointStore(offline.checkpoint_dir).lineage()
    assert lineage_problems(again) == []
    assert sorted(tuple(k) for s in again for k in s["used"]) == sorted(
        tuple(k) for s in states for k in s["used"]
    )
    assert not [e for e in await published(kafka) if e.resources_id.startswith("offline")]


async def test_groups_that_never_fill_are_dropped_past_the_bound(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    """Tasks with fewer attempts than a group needs (every input unique, say) would wait for
    ever: past --max-waiting the oldest groups that are not full leave, counted, and the
    trajectories waiting stay bounded while full groups still make steps."""
    config = TrainerConfig(
        checkpoint_dir=str(tmp_path / "checkpoints"), run_name="bound", group_size=4,
        groups_per_step=1, max_steps=1, max_waiting=4, heartbeat_seconds=1.0,
    )  # fmt: skip
    trainer = Trainer(kafka, config)
    training = asyncio.create_task(trainer.run(asyncio.Event()))
    async with runner_in_process(kafka, AGENT, concurrency=8):

        async def out() -> bool:
            return any(e.resources_id == "bound-v0" for e in await published(kafka))

        await eventually(out, 60, "the trainer to publish bound-v0")
        for n in range(6):  # six tasks of one attempt each: their groups never fill
            await queue(kafka, [{"letter": "a"}], resources_id="bound-v0",
                        metadata={"group": f"single-{n}"})  # fmt: skip

        async def two_dropped() -> bool:
            assert trainer.groups.waiting() <= 4
            return trainer.counts["dropped_incomplete"] == 2

        await eventually(two_dropped, 60, "the two oldest single groups to be dropped")
        await enqueue_group_tasks(kafka, "bound-v0", groups=1, size=4)
        await asyncio.wait_for(training, 120)

    states = CheckpointStore(config.checkpoint_dir).lineage()
    assert lineage_problems(states) == []
    assert len(states[1]["used"]) == 4  # the full group, trained on
    # The newest group filled while the four single ones left to make room for it.
    assert states[1]["counts"]["dropped_incomplete"] == 6
    assert states[1]["counts"]["assembler_attempts_dropped_incomplete"] == 6
    version = next(e for e in await published(kafka) if e.resources_id == "bound-v1")
    assert version.metadata["dropped_incomplete"] == "6"
