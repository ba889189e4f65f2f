"""Worker liveness."""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar

from pydantic import Field

from agl_stream.events.base import MAX_INT, Event
from agl_stream.events.ids import Id


class WorkerRole(StrEnum):
    RUNNER = "runner"
    PROJECTOR = "projector"
    TRAINER = "trainer"
    OTHER = "other"


class WorkerStatus(StrEnum):
    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    STOPPING = "stopping"
    STOPPED = "stopped"


class WorkerHeartbeat(Event):
    key_field: ClassVar[str] = "worker_id"

    worker_id: Id
    role: WorkerRole
    status: WorkerStatus
    hostname: str
    pid: int = Field(ge=0, le=MAX_INT)
    current_rollouts: tuple[Id, ...] = ()
    counts: dict[str, int] = Field(default_factory=dict)
    interval_seconds: float = Field(gt=0)
