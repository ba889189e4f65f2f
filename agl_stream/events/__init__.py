"""Event contracts. Each class mirrors one Avro schema under schemas/ field by field."""

from agl_stream.events.agl import AglRecordKind, AglRecordRevised
from agl_stream.events.base import AttemptStatus, ErrorInfo, Event, RolloutMode
from agl_stream.events.resources import (
    LLM,
    PIN_ONLY,
    Checkpoint,
    PromptTemplate,
    Resource,
    ResourcesPublished,
    TemplateEngine,
)
from agl_stream.events.rewards import DEFAULT_REWARD_NAME, RewardRecorded
from agl_stream.events.rollouts import (
    AttemptFinished,
    AttemptStarted,
    AttemptTask,
    RolloutCancelled,
    RolloutFinished,
    RolloutQueued,
    RolloutStatus,
)
from agl_stream.events.spans import (
    SpanEvent,
    SpanKind,
    SpanLink,
    SpanRecorded,
    SpanStatus,
    StatusCode,
)
from agl_stream.events.workers import WorkerHeartbeat, WorkerRole, WorkerStatus

EVENT_TYPES: dict[str, type[Event]] = {
    cls.__name__: cls
    for cls in (
        RolloutQueued,
        RolloutCancelled,
        AttemptStarted,
        AttemptFinished,
        RolloutFinished,
        RewardRecorded,
        SpanRecorded,
        ResourcesPublished,
        WorkerHeartbeat,
        AglRecordRevised,
    )
}

__all__ = [
    "DEFAULT_REWARD_NAME",
    "EVENT_TYPES",
    "LLM",
    "PIN_ONLY",
    "AglRecordKind",
    "AglRecordRevised",
    "AttemptFinished",
    "AttemptStarted",
    "AttemptStatus",
    "AttemptTask",
    "Checkpoint",
    "ErrorInfo",
    "Event",
    "PromptTemplate",
    "Resource",
    "ResourcesPublished",
    "RewardRecorded",
    "RolloutCancelled",
    "RolloutFinished",
    "RolloutMode",
    "RolloutQueued",
    "RolloutStatus",
    "SpanEvent",
    "SpanKind",
    "SpanLink",
    "SpanRecorded",
    "SpanStatus",
    "StatusCode",
    "TemplateEngine",
    "WorkerHeartbeat",
    "WorkerRole",
    "WorkerStatus",
]
