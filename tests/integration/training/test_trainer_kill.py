"""Kill -9 the trainer process again and again while it trains: after each restart it goes
on from its latest checkpoint, and the lineage shows every consumed offset range once and
every attempt trained on exactly once."""

from __future__ import annotations

import asyncio
import random
import signal
from asyncio.subprocess import Process
from pathlib import Path

import pytest

from agl_stream.events import AttemptStatus
from agl_stream.runtime.config import KafkaSettings
from agl_stream.training.checkpoints import CheckpointStore, lineage_problems
from tests.integration.training.test_trainer import AGENT, published
from tests.support.helpers import eventually
from tests.support.runs import history, queue, runner_in_process, trainer_process

pytestmark = pytest.mark.slow

GROUPS, GROUP_SIZE, GROUPS_PER_STEP = 64, 4, 4  # 256 attempts, 16 steps


async def start_trainer(kafka: KafkaSettings, checkpoints: Path, log: Path) -> Process:
    return await trainer_process(kafka, checkpoints, log, "kill", GROUP_SIZE, GROUPS_PER_STEP)


def trained(store: CheckpointStore) -> int:
    return sum(len(s["used"]) for s in store.lineage())


async def test_kill_the_trainer_mid_run(kafka: KafkaSettings, tmp_path: Path) -> None:
    rng = random.Random(7)
    store = CheckpointStore(str(tmp_path / "checkpoints"))
    log = tmp_path / "trainer.log"
    trainer = await start_trainer(kafka, store.root, log)
    kills = 0
    try:

        async def first_version() -> bool:
            return any(e.resources_id == "kill-v0" for e in await published(kafka))

        await eventually(first_version, 90, "the trainer to publish its first version")
        async with runner_in_process(kafka, AGENT, concurrency=8):
            for g in range(GROUPS):
                await queue(
                    kafka, [{"letter": "abcde"[g % 5]}] * GROUP_SIZE,
                    metadata={"group": f"kill-{g}"},
                )  # fmt: skip
            for _ in range(3):
                steps_before = len(store.steps())

                async def progressed(n: int = steps_before) -> bool:
                    return len(store.steps()) > n

                await eventually(progressed, 120, "the trainer to make a step")
                await asyncio.sleep(rng.uniform(0, 1.5))  # anywhere: mid-update, mid-write
                trainer.send_signal(signal.SIGKILL)
                await trainer.wait()
                kills += 1
                trainer = await start_trainer(kafka, store.root, log)

            async def all_trained() -> bool:
                return trained(store) >= GROUPS * GROUP_SIZE

            await eventually(all_trained, 240, "the trainer to train on every attempt")
            h = await history(kafka)
    finally:
        if trainer.returncode is None:
            trainer.send_signal(signal.SIGTERM)
            await asyncio.wait_for(trainer.wait(), 60)

    states = store.lineage()
    assert lineage_problems(states) == [], log.read_text()[-3000:]
    used = [tuple(k) for s in states for k in s["used"]]
    succeeded = {
        (a.rollout_id, a.attempt_id)
        for finished in h.finished.values()
        for a in finished
        if a.status == AttemptStatus.SUCCEEDED
    }
    assert len(used) == len(set(used)) == GROUPS * GROUP_SIZE
    assert set(used) == succeeded
    assert kills == 3
    assert not list(store.root.glob("*.partial-*"))
    # The ranges start where the run started and never pass what was on the topics.
    assert all(start == 0 for start, _ in states[1]["consumed"].values())
