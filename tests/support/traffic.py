"""Synthetic but well-formed event traffic, as runners, producers and trainers would write
it: rollouts with retries, cancellations, spans, resources versions and heartbeats."""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime, timedelta

from agl_stream.events import (
    LLM,
    AttemptFinished,
    AttemptStarted,
    AttemptStatus,
    ErrorInfo,
    Event,
    PromptTemplate,
    ResourcesPublished,
    RolloutCancelled,
    RolloutFinished,
    RolloutMode,
    RolloutQueued,
    RolloutStatus,
    SpanRecorded,
    WorkerHeartbeat,
    WorkerRole,
    WorkerStatus,
)

Traffic = list[tuple[str, Event]]  # (short topic, event), in the order a system wrote them


def rollout_traffic(rng: random.Random, rollout_id: str, at: datetime) -> Traffic:
    """One rollout's life: 1-3 attempts, each with spans; some are cancelled."""
    out: Traffic = []
    tick = iter(range(1, 10_000))

    def t() -> datetime:
        return at + timedelta(milliseconds=next(tick) * rng.randint(1, 50))

    attempts = rng.randint(1, 3)
    mode = rng.choice(list(RolloutMode))
    meta = {"team": rng.choice(["a", "b"]), "n": str(rng.randint(0, 9))}
    worker = f"runner-{rng.randint(0, 3)}"
    resources_id = rng.choice([None, "res-1", "res-2"])
    for number in range(1, attempts + 1):
        out.append(("tasks", RolloutQueued(
            rollout_id=rollout_id, attempt_number=number, input_json='{"q": 1}', mode=mode,
            max_attempts=attempts, retry_condition=(AttemptStatus.FAILED,), metadata=meta,
            first_queued_at=at, occurred_at=t(), resources_id=resources_id,
        )))  # fmt: skip
        if rng.random() < 0.1:
            out.append(("tasks", RolloutCancelled(rollout_id=rollout_id, occurred_at=t())))
            out.append(("rollouts", RolloutFinished(
                rollout_id=rollout_id, status=RolloutStatus.CANCELLED, attempt_count=number - 1,
                occurred_at=t(),
            )))  # fmt: skip
            return out
        attempt_id = f"at-{uuid.UUID(int=rng.getrandbits(128)).hex[:12]}"
        out.append(("rollouts", AttemptStarted(
            rollout_id=rollout_id, attempt_id=attempt_id, attempt_number=number,
            worker_id=worker, resources_id=resources_id or "res-2", occurred_at=t(),
        )))  # fmt: skip
        spans = rng.randint(0, 6)
        trace = f"{rng.getrandbits(128):032x}"
        for sequence in range(spans):
            start = int(t().timestamp() * 1e9)
            out.append(("spans", SpanRecorded(
                rollout_id=rollout_id, attempt_id=attempt_id, sequence=sequence,
                trace_id=trace, span_id=f"{rng.getrandbits(64):016x}",
                name=rng.choice(["llm.call", "tool.call", "agl.reward"]),
                start_time_unix_nano=start, end_time_unix_nano=start + 1000,
                attributes={"i": sequence, "text": "x" * rng.randint(1, 50), "ok": True},
                occurred_at=t(),
            )))  # fmt: skip
        last = number == attempts
        status = AttemptStatus.SUCCEEDED if last else AttemptStatus.FAILED
        error = None if last else ErrorInfo(type="ValueError", message=f"attempt {number}")
        out.append(("rollouts", AttemptFinished(
            rollout_id=rollout_id, attempt_id=attempt_id, attempt_number=number,
            worker_id=worker, status=status, error=error, span_count=spans,
            reward=rng.random() if last else None, occurred_at=t(),
        )))  # fmt: skip
        if last:
            out.append(("rollouts", RolloutFinished(
                rollout_id=rollout_id, status=RolloutStatus.SUCCEEDED, attempt_id=attempt_id,
                attempt_count=number, occurred_at=t(),
            )))  # fmt: skip
    return out


def side_traffic(rng: random.Random, at: datetime, n: int) -> Traffic:
    """Resources versions and worker heartbeats."""
    out: Traffic = []
    for version in range(n):
        out.append(("resources", ResourcesPublished(
            resources_id=f"res-{version + 1}", version=version,
            resources={
                "llm": LLM(endpoint="http://localhost:8000/v1", model="m"),
                "prompt": PromptTemplate(template=f"v{version}: {{question}}"),
            },
            occurred_at=at + timedelta(seconds=version),
        )))  # fmt: skip
    for i in range(n * 3):
        out.append(("workers", WorkerHeartbeat(
            worker_id=f"runner-{i % 4}", role=WorkerRole.RUNNER,
            status=rng.choice([WorkerStatus.IDLE, WorkerStatus.BUSY]), hostname="h", pid=i,
            interval_seconds=5.0, occurred_at=at + timedelta(seconds=i),
        )))  # fmt: skip
    return out


def traffic(seed: int, rollouts: int, prefix: str = "ro") -> Traffic:
    """Many rollouts, their events interleaved as concurrent runners would write them."""
    rng = random.Random(seed)
    at = datetime(2026, 11, 1, tzinfo=UTC)
    streams = [rollout_traffic(rng, f"{prefix}-{i:05d}", at) for i in range(rollouts)]
    streams.append(side_traffic(rng, at, 5))
    out: Traffic = []
    while streams:
        stream = rng.choice(streams)
        out.append(stream.pop(0))
        if not stream:
            streams.remove(stream)
    return out + resent(rng, out, 0.05)


def resent(rng: random.Random, sent: Traffic, share: float) -> Traffic:
    """What at-least-once writers add: the same fact again from another process, as a new
    event (new id, later time), a cancelled rollout finishing twice, a heartbeat re-sent."""
    out: Traffic = []
    for topic, event in sent:
        if rng.random() < share and not isinstance(event, SpanRecorded):
            later = event.occurred_at + timedelta(milliseconds=rng.randint(1, 5000))
            update: dict[str, object] = {
                "event_id": uuid.UUID(int=rng.getrandbits(128)),
                "occurred_at": later,
            }
            if isinstance(event, RolloutFinished) and rng.random() < 0.5:
                update["status"] = RolloutStatus.FAILED
            out.append((topic, event.model_copy(update=update)))
    return out
