"""Pure logic of the store facade: Agent Lightning's records as the facade keeps them, and the
changes each store call makes to them (no I/O here).

A record travels as an AglRecordRevised event whose body is {"record": <the model as Agent
Lightning dumps it>, ...the facade's own fields}: a rollout's `queued_at` (its place in the
queue, None when it is not queued) and `span_sequence_reserved` (the span sequence ids this
store may hand out for it without writing again).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from agentlightning.store.utils import rollout_status_from_attempt
from agentlightning.types import (
    Attempt,
    AttemptStatus,
    ResourcesUpdate,
    Rollout,
    RolloutStatus,
    Worker,
)

QUEUING: frozenset[str] = frozenset({"queuing", "requeuing"})
RUNNING: frozenset[str] = frozenset({"preparing", "running"})
FINISHED: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})
# A new rollout may hand out this many span sequence ids before the store writes again.
SEQUENCE_BLOCK = 64


@dataclass(frozen=True)
class RolloutRecord:
    rollout: Rollout
    revision: int = 0  # 0: not written yet
    created_at: float = 0.0
    queued_at: float | None = None
    span_sequence_reserved: int = 0

    def body(self) -> dict[str, Any]:
        return {
            "record": self.rollout.model_dump(mode="json"),
            "queued_at": self.queued_at,
            "span_sequence_reserved": self.span_sequence_reserved,
        }

    @staticmethod
    def from_body(body: dict[str, Any], revision: int, created_at: float) -> RolloutRecord:
        return RolloutRecord(
            Rollout.model_validate(body["record"]),
            revision,
            created_at,
            body.get("queued_at"),
            int(body.get("span_sequence_reserved") or 0),
        )


@dataclass(frozen=True)
class AttemptRecord:
    attempt: Attempt
    revision: int = 0
    created_at: float = 0.0

    def body(self) -> dict[str, Any]:
        return {"record": self.attempt.model_dump(mode="json")}


@dataclass(frozen=True)
class WorkerRecord:
    worker: Worker
    revision: int = 0
    created_at: float = 0.0

    def body(self) -> dict[str, Any]:
        return {"record": self.worker.model_dump(mode="json")}


@dataclass(frozen=True)
class ResourcesRecord:
    update: ResourcesUpdate
    revision: int = 0
    created_at: float = 0.0

    def body(self) -> dict[str, Any]:
        return {"record": self.update.model_dump(mode="json")}


AnyRecord = RolloutRecord | AttemptRecord | WorkerRecord | ResourcesRecord


# ---- rollouts ------------------------------------------------------------------------------


def with_rollout_status(
    record: RolloutRecord, status: RolloutStatus, now: float, **fields: Any
) -> RolloutRecord:
    """The rollout in `status`: a finished one gets its end time; one that comes back to the
    queue goes to its tail (once: one already queued keeps its place); one that leaves the
    queue leaves it."""
    updates: dict[str, Any] = {"status": status, **fields}
    if status in FINISHED:
        updates["end_time"] = now
    queued_at = record.queued_at
    if status in QUEUING:
        if record.rollout.status not in QUEUING or queued_at is None:
            queued_at = now
    else:
        queued_at = None
    return replace(record, rollout=record.rollout.model_copy(update=updates), queued_at=queued_at)


def updated_rollout(record: RolloutRecord, now: float, changes: dict[str, Any]) -> RolloutRecord:
    """update_rollout: each field given (None included) replaces the stored one; a status
    given is applied as with_rollout_status does (a finished one stamps end_time even when
    it was finished before, as Agent Lightning does)."""
    status = changes.pop("status", None)
    rollout = record.rollout.model_copy(update=changes)
    Rollout.model_validate(rollout.model_dump())  # the fields must make a valid rollout
    out = replace(record, rollout=rollout)
    if status is not None:
        out = with_rollout_status(out, status, now)
    return out


# ---- attempts ------------------------------------------------------------------------------


def with_attempt_changes(
    attempt: Attempt, now: float, changes: dict[str, Any]
) -> tuple[Attempt, bool]:
    """update_attempt's fields on the attempt; whether its worker needs a sync (a worker id
    given, or a status given to an attempt with a worker)."""
    updates = dict(changes)
    sync = bool(updates.get("worker_id"))
    if "status" in updates:
        if updates["status"] in ("failed", "succeeded"):
            updates["end_time"] = now
        sync = sync or bool(updates.get("worker_id", attempt.worker_id))
    new = attempt.model_copy(update=updates)
    Attempt.model_validate(new.model_dump())
    return new, sync


async def rollout_after_attempt(
    record: RolloutRecord, attempt: Attempt, latest: Attempt, now: float
) -> RolloutRecord | None:
    """What the latest attempt's status makes of its rollout (None: unchanged). Only the
    latest attempt moves the rollout; a retryable failure with attempts left requeues it."""
    if attempt.attempt_id != latest.attempt_id:
        return None
    status = await rollout_status_from_attempt(attempt, record.rollout.config)
    if status == record.rollout.status:
        return None
    return with_rollout_status(record, status, now)


def heartbeat(attempt: Attempt, now: float) -> Attempt:
    """A span arrived: the attempt's heartbeat, and a preparing or unresponsive attempt is
    running again (a finished one keeps its status)."""
    status: AttemptStatus = attempt.status
    if status in ("preparing", "unresponsive"):
        status = "running"
    return attempt.model_copy(update={"last_heartbeat_time": now, "status": status})


def rollout_after_heartbeat(
    record: RolloutRecord, attempt: Attempt, latest: Attempt | None, now: float
) -> RolloutRecord | None:
    """A span of the latest attempt makes a preparing or requeuing rollout running."""
    if latest is None or attempt.attempt_id != latest.attempt_id:
        return None
    if record.rollout.status not in ("preparing", "requeuing"):
        return None
    return with_rollout_status(record, "running", now)


# ---- workers -------------------------------------------------------------------------------


def worker_after_attempt(worker: Worker, attempt: Attempt, now: float, dequeue: bool) -> Worker:
    """A worker follows the attempt it works on: idle after success or failure, unknown
    after a timeout or silence, busy otherwise."""
    updates: dict[str, Any] = {}
    if dequeue:
        updates["last_dequeue_time"] = now
    if attempt.status in ("succeeded", "failed"):
        updates.update(
            last_idle_time=now, status="idle", current_rollout_id=None, current_attempt_id=None
        )
    elif attempt.status in ("timeout", "unresponsive"):
        updates.update(
            last_idle_time=now, status="unknown", current_rollout_id=None, current_attempt_id=None
        )
    else:
        updates.update(
            last_busy_time=now,
            status="busy",
            current_rollout_id=attempt.rollout_id,
            current_attempt_id=attempt.attempt_id,
        )
    return worker.model_copy(update=updates)


def worker_after_empty_dequeue(worker: Worker, now: float) -> Worker:
    """A dequeue that found nothing: the worker is idle (stamped once) and was seen asking."""
    if worker.status != "idle":
        return worker.model_copy(
            update={"status": "idle", "last_idle_time": now, "last_dequeue_time": now}
        )
    return worker.model_copy(update={"last_dequeue_time": now})


# ---- the watchdog ----------------------------------------------------------------------------


def unhealthy_status(
    rollout: Rollout, attempt: Attempt, now: float
) -> Literal["timeout", "unresponsive"] | None:
    """The status the watchdog gives the latest attempt of a running rollout, if any: timeout
    after timeout_seconds from its start, unresponsive after unresponsive_seconds without a
    heartbeat (from its start when it never sent one)."""
    config = rollout.config
    if config.timeout_seconds is not None and now - attempt.start_time > config.timeout_seconds:
        return "timeout"
    if config.unresponsive_seconds is not None:
        since = attempt.last_heartbeat_time or attempt.start_time
        if now - since > config.unresponsive_seconds:
            return "unresponsive"
    return None


def replace_reserved(record: RolloutRecord, reserved: int) -> RolloutRecord:
    """The rollout with span sequence ids up to `reserved` set aside for this store."""
    return replace(record, span_sequence_reserved=reserved)
