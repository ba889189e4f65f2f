"""One fixed event of each type: the wire format is pinned against these (their bytes are in
golden_bytes.json beside this file)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from agl_stream.events import (
    LLM,
    AglRecordKind,
    AglRecordRevised,
    AttemptFinished,
    AttemptStarted,
    AttemptStatus,
    Checkpoint,
    ErrorInfo,
    Event,
    PromptTemplate,
    ResourcesPublished,
    RewardRecorded,
    RolloutCancelled,
    RolloutFinished,
    RolloutMode,
    RolloutQueued,
    RolloutStatus,
    SpanEvent,
    SpanKind,
    SpanLink,
    SpanRecorded,
    SpanStatus,
    StatusCode,
    WorkerHeartbeat,
    WorkerRole,
    WorkerStatus,
)

ID = uuid.UUID("12345678-1234-5678-1234-567812345678")
AT = datetime(2026, 11, 21, 6, 0, 0, 123456, tzinfo=UTC)
T0 = 1_795_240_800_000_000_000

GOLDEN_EVENTS: dict[str, Event] = {
    "RolloutQueued": RolloutQueued(
        event_id=ID, occurred_at=AT, rollout_id="ro-1", attempt_number=2,
        input_json='{"question": "2+2?"}', mode=RolloutMode.TRAIN, resources_id="res-7",
        timeout_seconds=30.0, unresponsive_seconds=10.0, max_attempts=3,
        retry_condition=(AttemptStatus.FAILED, AttemptStatus.TIMEOUT),
        metadata={"dataset": "gsm8k"}, first_queued_at=AT, previous_attempt_id="at-1",
    ),
    "RolloutCancelled": RolloutCancelled(
        event_id=ID, occurred_at=AT, rollout_id="ro-1", reason="operator", requested_by="cli",
    ),
    "AttemptStarted": AttemptStarted(
        event_id=ID, occurred_at=AT, rollout_id="ro-1", attempt_id="at-2", attempt_number=2,
        worker_id="runner-a", resources_id="res-7", task_offset=41,
    ),
    "AttemptFinished": AttemptFinished(
        event_id=ID, occurred_at=AT, rollout_id="ro-1", attempt_id="at-2", attempt_number=2,
        worker_id="runner-a", status=AttemptStatus.FAILED,
        error=ErrorInfo(type="ValueError", message="bad answer", traceback=None),
        span_count=5, reward=0.25,
    ),
    "RolloutFinished": RolloutFinished(
        event_id=ID, occurred_at=AT, rollout_id="ro-1", status=RolloutStatus.SUCCEEDED,
        attempt_id="at-2", attempt_count=2, error=None,
    ),
    "RewardRecorded": RewardRecorded(
        event_id=ID, occurred_at=AT, rollout_id="ro-1", attempt_id="at-2",
        span_id="b7ad6b7169203331", name="thumbs", value=1.0, source="http",
        metadata={"user": "u-9"},
    ),
    "SpanRecorded": SpanRecorded(
        event_id=ID, occurred_at=AT, rollout_id="ro-1", attempt_id="at-2", sequence=3,
        trace_id="0af7651916cd43dd8448eb211c80319c", span_id="b7ad6b7169203331",
        parent_span_id="00f067aa0ba902b7", name="openai.chat.completion", kind=SpanKind.CLIENT,
        start_time_unix_nano=T0, end_time_unix_nano=T0 + 1_500_000,
        status=SpanStatus(code=StatusCode.OK),
        attributes={"gen_ai.usage.input_tokens": 12, "stream": False, "temperature": 0.7,
                    "gen_ai.request.model": "tiny", "token_ids": [1, 2, 3], "nothing": None},
        events=(SpanEvent(name="first_token", time_unix_nano=T0 + 10, attributes={"i": 0}),),
        links=(SpanLink(trace_id="0af7651916cd43dd8448eb211c80319c", span_id="00f067aa0ba902b7"),),
        resource={"service.name": "agent"}, scope_name="agl_stream",
    ),
    "ResourcesPublished": ResourcesPublished(
        event_id=ID, occurred_at=AT, resources_id="res-7", version=7,
        resources={
            "main_llm": LLM(endpoint="http://127.0.0.1:8000/v1", model="tiny", sampling_parameters={"temperature": 0.7}),
            "system_prompt": PromptTemplate(template="You are {role}."),
            "policy": Checkpoint(uri="file:///ckpt/7", content_hash="sha256:" + "ab" * 32),
        },
        published_by="trainer-1", parent_resources_id="res-6", metadata={"step": "7"},
    ),
    "WorkerHeartbeat": WorkerHeartbeat(
        event_id=ID, occurred_at=AT, worker_id="runner-a", role=WorkerRole.RUNNER,
        status=WorkerStatus.BUSY, hostname="host-1", pid=4242, current_rollouts=("ro-1",),
        counts={"attempts_succeeded": 10}, interval_seconds=5.0,
    ),
    "AglRecordRevised": AglRecordRevised(
        event_id=ID, occurred_at=AT, kind=AglRecordKind.ATTEMPT, partition_key="ro-1", record_id="at-2",
        rollout_id="ro-1", revision=3, created_at=AT,
        body_json='{"record": {"rollout_id": "ro-1", "attempt_id": "at-2", "status": "running"}}',
    ),
}  # fmt: skip
