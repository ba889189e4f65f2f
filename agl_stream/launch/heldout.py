"""Held-out evaluation through the pipeline: every item of a fixed set is queued as a `val`
rollout pinned to the version evaluated, runs in the runners like any rollout (the agent
answers greedily in val mode), and its reward comes back on the rollouts topic. The trainer
never trains on val attempts."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka import TopicPartition

from agl_stream.bus.kafka import consumer, end_offsets
from agl_stream.bus.streams import EventPublisher, EventStream, Topics
from agl_stream.commands.enqueue import RolloutOptions, make_rollout
from agl_stream.commands.resources import Change, publish_resources
from agl_stream.events import (
    AttemptFinished,
    AttemptStatus,
    RolloutFinished,
    RolloutMode,
    RolloutStatus,
)
from agl_stream.runtime.config import KafkaSettings


@dataclass(frozen=True)
class Evaluation:
    """What is evaluated and when: the held-out items, before the first step (the base),
    every `every` steps and after the last."""

    items: tuple[dict[str, Any], ...]
    every: int = 10  # 0: the base and the last version only
    timeout_seconds: float = 600.0  # for the whole set

    def due(self, step: int, last: int) -> bool:
        return step in (0, last) or (self.every > 0 and step % self.every == 0)


@dataclass(frozen=True)
class EvalPoint:
    step: int
    resources_id: str
    accuracy: float
    correct: int
    items: int
    failed: int  # rollouts that failed for good: counted as wrong
    seconds: float  # from queueing the set to its last result

    @property
    def interval(self) -> tuple[float, float]:
        return wilson(self.correct, self.items)


def wilson(successes: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95% by default)."""
    if total <= 0:
        return (0.0, 1.0)
    p = successes / total
    denominator = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))


def accuracy(rewards: Sequence[float | None]) -> tuple[int, int]:
    """(correct, failed): a reward of 1 is correct; a rollout with no reward failed."""
    correct = sum(1 for r in rewards if r is not None and r >= 1.0)
    failed = sum(1 for r in rewards if r is None)
    return correct, failed


async def evaluate(
    kafka: KafkaSettings,
    publisher: EventPublisher,
    evaluation: Evaluation,
    resources_id: str,
    step: int,
    run_name: str,
) -> EvalPoint:
    """Queue the held-out set pinned to `resources_id` and wait for every rollout's end."""
    topics = Topics(kafka)
    tps = [
        TopicPartition(topics.name("rollouts"), p)
        for p in range(topics.specs["rollouts"].partitions)
    ]
    began = time.monotonic()
    ends = await end_offsets(kafka, tps)
    options = RolloutOptions(
        mode=RolloutMode.VAL, resources_id=resources_id, timeout_seconds=300.0,
        # An attempt that failed or timed out (a busy machine) runs again: a lost item
        # would count as wrong.
        max_attempts=3, retry_condition=(AttemptStatus.FAILED, AttemptStatus.TIMEOUT),
        metadata={"heldout": run_name, "heldout_step": str(step)},
    )  # fmt: skip
    batch = uuid.uuid4().hex[:8]
    wanted = {
        f"val-{run_name}-s{step}-{batch}-{i}": item for i, item in enumerate(evaluation.items)
    }
    rewards: dict[str, float | None] = {}
    attempts: dict[tuple[str, str], float | None] = {}
    async with consumer(kafka) as reader:
        reader.assign(tps)
        for tp in tps:
            reader.seek(tp, ends[tp])
        sent = [
            await publisher.send("tasks", make_rollout(item, options, rollout_id))
            for rollout_id, item in wanted.items()
        ]
        await asyncio.gather(*sent)
        stream = EventStream(reader, None, topics, "demo-heldout")
        deadline = began + evaluation.timeout_seconds
        while len(rewards) < len(wanted):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the held-out evaluation of {resources_id} did not end within "
                    f"{evaluation.timeout_seconds:.0f} s ({len(rewards)} of {len(wanted)} done)"
                )
            for record in await stream.next_batch(timeout_ms=500):
                event = record.event
                if isinstance(event, AttemptFinished) and event.rollout_id in wanted:
                    attempts[(event.rollout_id, event.attempt_id)] = event.reward
                elif isinstance(event, RolloutFinished) and event.rollout_id in wanted:
                    succeeded = event.status is RolloutStatus.SUCCEEDED
                    key = (event.rollout_id, event.attempt_id or "")
                    rewards[event.rollout_id] = attempts.get(key) if succeeded else None
    correct, failed = accuracy(list(rewards.values()))
    return EvalPoint(
        step, resources_id, correct / len(wanted), correct, len(wanted), failed,
        time.monotonic() - began,
    )  # fmt: skip


HELDOUT_RUN = "heldout_run"  # the metadata keys of a published result (dashboard/runs.py)


async def publish_result(kafka: KafkaSettings, point: EvalPoint, run_name: str) -> None:
    """The result as a pin-only resources version (never the latest: nothing reloads)
    holding the evaluated policy, so the read model and the dashboard show the held-out
    curve beside the run's reward curve. Its step is `heldout_step`, not `step`: a trainer
    that restarts looks for its own versions by `step`."""
    low, high = point.interval
    metadata = {
        HELDOUT_RUN: run_name, "heldout_step": str(point.step),
        "heldout_accuracy": f"{point.accuracy:.6f}", "heldout_correct": str(point.correct),
        "heldout_items": str(point.items), "heldout_interval_95": f"{low:.4f}-{high:.4f}",
        "evaluated_resources_id": point.resources_id,
    }  # fmt: skip
    change = Change(
        resources={}, id_prefix=f"{run_name}-heldout", pin_only=True, metadata=metadata,
        parent_resources_id=point.resources_id,
    )  # fmt: skip
    await publish_resources(kafka, change, published_by="demo")
