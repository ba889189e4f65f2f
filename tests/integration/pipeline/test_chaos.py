"""The whole pipeline under fire, on a 3-node Kafka cluster (replication 3, two in sync):
runners, a projector and a trainer as real processes while tasks trickle in, and meanwhile
kill -9 of random workers (restarted), kill -9 of a Kafka node (the active controller first,
then any; restarted with its data), a node frozen with SIGSTOP, malformed records into every
topic. Afterwards, through the query API: every rollout is terminal with the status its
task calls for, no rollout has two succeeded attempts, every finished attempt has all its
spans, the read model equals a replay from scratch, the trainer's lineage has each consumed
offset once, and every malformed record sits in the dead-letter topic with a reason.
Size: --chaos-size ci (default) or long."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from pathlib import Path

import pytest

from agl_stream.bus.codec import Codec
from agl_stream.events import AttemptStatus
from agl_stream.queries import ReadModel
from agl_stream.queries.dead_letters import read_dead_letters
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings
from agl_stream.training.checkpoints import CheckpointStore, lineage_problems
from tests.integration.training.test_trainer import published
from tests.support.backends import Backend
from tests.support.bad_records import EXPECTED_KIND
from tests.support.chaos import FAULTS, RUN, SIZES, ChaosSize, Crew, Summary, inject_malformed
from tests.support.helpers import eventually
from tests.support.projection import caught_up, dump, ends, replay_differences
from tests.support.runs import queue

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(1500)]

TERMINAL = ("succeeded", "failed", "cancelled")
RETRY = (AttemptStatus.FAILED, AttemptStatus.TIMEOUT, AttemptStatus.UNRESPONSIVE)


def chaos_tasks(rng: random.Random, count: int) -> tuple[list[dict[str, object]], set[int]]:
    """Echo tasks (identical inputs make the trainer's groups); about one in ten fails its
    first attempt (a retry succeeds), one in thirty fails every attempt (the rollout fails).
    Returns the tasks and the indexes of those that must end failed."""
    tasks: list[dict[str, object]] = []
    doomed = set()
    for i in range(count):
        task: dict[str, object] = {"letter": rng.choice("abcde"), "sleep": 0.3}
        draw = rng.random()
        if draw < 1 / 30:
            task["fail_on_attempts"] = [1, 2, 3]
            doomed.add(i)
        elif draw < 0.13:
            task["fail_on_attempts"] = [1]
        tasks.append(task)
    return tasks, doomed


async def trickle(
    kafka: KafkaSettings, tasks: list[dict[str, object]], seconds: float, ids: list[str]
) -> None:
    """Queue the tasks in small batches spread over `seconds`."""
    chunk = 10
    pause = seconds / max(len(tasks) / chunk, 1)
    for start in range(0, len(tasks), chunk):
        ids += await queue(
            kafka, tasks[start : start + chunk], max_attempts=3, retry_condition=RETRY,
            timeout_seconds=120,
        )  # fmt: skip
        await asyncio.sleep(pause)


async def terminal_count(database: DatabaseSettings) -> int:
    async with ReadModel.open(database) as rm:
        counts = await rm.status_counts()
    return sum(counts.get(status, 0) for status in TERMINAL)


async def fault(
    kind: str, crew: Crew, backend: Backend, kafka: KafkaSettings, rng: random.Random,
    summary: Summary, malformed: dict[tuple[str, int, int], str],
) -> None:  # fmt: skip
    if kind == "runner killed":
        await crew.kill(rng.choice(crew.of("runner")), rng)
    elif kind == "projector killed":
        await crew.kill(crew.of("projector")[0], rng)
    elif kind == "trainer killed":
        await crew.kill(crew.of("trainer")[0], rng)
    elif kind == "broker killed":
        # The active controller first: its loss moves the quorum's leadership too.
        controller = backend.stack.active_controller() if backend.stack else None
        node = controller if not summary.faults[kind] and controller else None
        node = node or rng.choice(backend.node_ids())
        summary.controller_kills += node == controller
        await backend.kill_and_restart_broker(node, rng.uniform(2, 6))
    elif kind == "broker paused":
        seconds = rng.uniform(3, 7)
        if backend.can_kill_brokers:
            await backend.pause_node(rng.choice(backend.node_ids()), seconds)
        else:
            await backend.pause_broker(seconds)
        summary.paused_seconds += seconds
    else:
        malformed.update(await inject_malformed(kafka, Codec()))
    summary.faults[kind] += 1


@pytest.mark.parametrize("backend", ["cluster"], indirect=True)
async def test_chaos(
    backend: Backend,
    kafka: KafkaSettings,
    database: DatabaseSettings,
    tmp_path: Path,
    chaos_size: str,
    chaos_summaries: list[str],
) -> None:
    size: ChaosSize = SIZES[chaos_size]
    rng = random.Random(2026)
    kinds = [
        k
        for k in FAULTS
        if (k != "broker paused" or backend.can_pause or backend.can_kill_brokers)
        and (k != "broker killed" or backend.can_kill_brokers)
    ]
    summary = Summary(chaos_size, size, brokers=backend.name)
    store = CheckpointStore(str(tmp_path / "checkpoints"))
    crew = Crew(kafka, database, tmp_path / "logs", store.root)
    tasks, doomed = chaos_tasks(rng, size.rollouts)
    ids: list[str] = []
    malformed: dict[tuple[str, int, int], str] = {}
    began = time.monotonic()
    try:
        await crew.start("trainer", "trainer")

        async def first_version() -> bool:
            return any(e.resources_id == f"{RUN}-v0" for e in await published(kafka))

        await eventually(first_version, 120, "the trainer to publish its first version")
        await crew.start("projector", "projector")
        for i in range(size.runners):
            await crew.start("runner", f"runner-{i}")
        enqueuing = asyncio.create_task(trickle(kafka, tasks, size.enqueue_seconds, ids))

        # Faults until the work is done: each kind at least once, in a random order first.
        plan = rng.sample(kinds, len(kinds))
        deadline = time.monotonic() + size.enqueue_seconds + size.finish_within
        while True:
            await asyncio.sleep(rng.uniform(*size.fault_every))
            await crew.revive_the_dead()
            if enqueuing.done() and not plan and await terminal_count(database) >= len(tasks):
                break
            if time.monotonic() > deadline:
                break
            kind = plan.pop() if plan else rng.choice([*kinds, "runner killed"])
            await fault(kind, crew, backend, kafka, rng, summary, malformed)
        await enqueuing

        # The workers stop cleanly; the projector catches up with everything on the topics.
        await crew.stop("runner")
        await crew.stop("trainer")
        final = await ends(kafka)
        await eventually(lambda: caught_up(database, final), 180, "the projector to catch up")
        await crew.stop("projector")
    finally:
        await crew.stop_all()
    summary.seconds = time.monotonic() - began
    summary.restarts = crew.restarts
    summary.died = len(crew.died)

    # What the query API says.
    live = await dump(database)
    wanted = {rollout_id: index for index, rollout_id in enumerate(ids)}
    not_terminal, wrong_status, doubled, incomplete, twice = [], [], [], [], []
    for rollout_id, index in wanted.items():
        entry = live.get(rollout_id)
        if entry is None or entry["rollout"]["status"] not in TERMINAL:
            not_terminal.append(rollout_id)
            continue
        status = entry["rollout"]["status"]
        summary.statuses[status] += 1
        if status != ("failed" if index in doomed else "succeeded"):
            wrong_status.append((rollout_id, status))
        attempts = entry["attempts"]
        summary.attempts += len(attempts)
        succeeded = [a for a in attempts if a["status"] == "succeeded"]
        if len(succeeded) > 1:
            # How each attempt ran, to find the cause if it ever shows again.
            twice.append(
                (rollout_id, [(a["attempt_number"], a["worker_id"], a["status"]) for a in attempts])
            )
        counted = entry["rollout"]["reward"]
        if status == "succeeded" and counted not in {a["reward"] for a in succeeded}:
            doubled.append((rollout_id, counted))
        for a in attempts:
            if a["finished_at"] is not None and a["spans_received"] != a["span_count"]:
                incomplete.append((a["attempt_id"], a["spans_received"], a["span_count"]))
        summary.spans += len(entry["spans"])
    summary.reruns = summary.attempts - len(wanted)
    summary.second_successes = len(twice)

    # The trainer: every consumed range once, every attempt it trained on a real success.
    states = store.lineage()
    problems = lineage_problems(states)
    used = [tuple(k) for s in states for k in s["used"]]
    succeeded_keys = {
        (rid, a["attempt_id"])
        for rid in wanted
        for a in live.get(rid, {}).get("attempts", [])
        if a["status"] == "succeeded"
    }
    summary.trainer_steps = len(states) - 1
    summary.trained_attempts = len(used)
    not_trainable = [k for k in used if k not in succeeded_keys]

    # Dead letters: each malformed record, with its kind and a reason.
    letters = await read_dead_letters(kafka, limit=100_000)
    summary.dead_letters = len(letters)
    found = {
        (x.source_topic, x.source_partition, x.source_offset): x
        for x in letters
        if x.reason and x.reason != "?"
    }
    summary.malformed_sent = len(malformed)
    missing_letters = [
        (source, label)
        for source, label in malformed.items()
        if source not in found or found[source].kind != EXPECTED_KIND[label]
    ]
    summary.malformed_found = len(malformed) - len(missing_letters)

    # The read model against a replay of the same records into an empty one.
    differ, rebuilt = await replay_differences(kafka, database)
    summary.replay_rows = {
        "rollouts": len(rebuilt) - 2,
        "spans": sum(len(v["spans"]) for k, v in rebuilt.items() if k in wanted),
        "resources versions": len(rebuilt["resources"]),
        "workers": len(rebuilt["workers"]),
    }

    summary.lost = {
        "rollouts not terminal": not_terminal,
        "rollouts with the wrong status": wrong_status,
        "succeeded rollouts whose reward is no succeeded attempt's": doubled,
        "incomplete attempts": incomplete,
        "malformed records not dead-lettered": missing_letters,
        "differences from a replay": differ,
        "lineage problems": problems,
        "trained attempts that did not succeed": not_trainable,
        "rollouts run to success twice": twice,
        "rollouts trained on twice": [r for r, n in Counter(r for r, _ in used).items() if n > 1],
        "workers that died by themselves": crew.died,
    }
    chaos_summaries.append(summary.render())

    assert summary.lost_count == 0, summary.render()
    assert summary.faults.keys() >= set(kinds), summary.faults
    assert summary.trainer_steps >= 3, "the trainer hardly trained; the test proved little"
    assert len(ids) == size.rollouts
