"""Hypothesis strategies that build valid events of every type."""

from __future__ import annotations

from datetime import UTC, datetime

from hypothesis import strategies as st

from agl_stream.events import (
    LLM,
    AglRecordKind,
    AglRecordRevised,
    AttemptFinished,
    AttemptStarted,
    AttemptStatus,
    AttemptTask,
    Checkpoint,
    ErrorInfo,
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
    TemplateEngine,
    WorkerHeartbeat,
    WorkerRole,
    WorkerStatus,
)
from agl_stream.events.rollouts import TERMINAL_ATTEMPT_STATUSES

text = st.text(max_size=40)
ident = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=24)
# What events/ids.py takes: printable characters (Python's str.isprintable) and not too many.
an_id = st.text(
    st.characters(exclude_categories=["Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"])
    | st.just(" "),
    min_size=1,
    max_size=24,
)
long = st.integers(min_value=-(2**63), max_value=2**63 - 1)
nonneg = st.integers(min_value=0, max_value=2**63 - 1)
finite = st.floats(allow_nan=False, allow_infinity=False)
# Avro timestamp-micros: whole microseconds, UTC.
times = st.datetimes(
    min_value=datetime(1970, 1, 1), max_value=datetime(2200, 1, 1), timezones=st.just(UTC)
)
hex32 = st.text("0123456789abcdef", min_size=32, max_size=32)
hex16 = st.text("0123456789abcdef", min_size=16, max_size=16)
scalar = st.one_of(st.none(), st.booleans(), long, finite, text)
attr_value = st.one_of(scalar, st.lists(scalar, max_size=4))
attributes = st.dictionaries(text, attr_value, max_size=4)
json_text = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), text),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(text, inner, max_size=3)),
    max_leaves=8,
).map(lambda v: __import__("json").dumps(v))
errors = st.builds(ErrorInfo, type=ident, message=text, traceback=st.none() | text)
metadata = st.dictionaries(text, text, max_size=3)
terminal = st.sampled_from(sorted(TERMINAL_ATTEMPT_STATUSES))


@st.composite
def rollout_queued(draw: st.DrawFn) -> RolloutQueued:
    max_attempts = draw(st.integers(1, 10))
    return RolloutQueued(
        event_id=draw(st.uuids()),
        occurred_at=draw(times),
        rollout_id=draw(an_id),
        attempt_number=draw(st.integers(1, max_attempts)),
        input_json=draw(json_text),
        mode=draw(st.sampled_from(RolloutMode)),
        resources_id=draw(st.none() | an_id),
        timeout_seconds=draw(st.none() | st.floats(0.001, 1e6)),
        unresponsive_seconds=draw(st.none() | st.floats(0.001, 1e6)),
        max_attempts=max_attempts,
        retry_condition=tuple(draw(st.lists(terminal, max_size=3))),
        metadata=draw(metadata),
        first_queued_at=draw(times),
        previous_attempt_id=draw(st.none() | an_id),
    )


common = {"event_id": st.uuids(), "occurred_at": times}
EVENT_STRATEGIES = {
    "RolloutQueued": rollout_queued(),
    "RolloutCancelled": st.builds(
        RolloutCancelled, rollout_id=an_id, reason=st.none() | text,
        requested_by=st.none() | text, **common,
    ),
    "AttemptStarted": st.builds(
        AttemptStarted, rollout_id=an_id, attempt_id=an_id, attempt_number=st.integers(1, 100),
        worker_id=an_id, resources_id=st.none() | an_id, task_offset=st.none() | nonneg,
        task=st.none() | st.builds(
            AttemptTask, input_json=json_text, mode=st.sampled_from(RolloutMode), metadata=metadata
        ),
        **common,
    ),
    "RewardRecorded": st.builds(
        RewardRecorded, rollout_id=an_id, attempt_id=st.none() | an_id, span_id=st.none() | hex16,
        name=ident, value=finite, source=st.none() | text, metadata=metadata, **common,
    ),
    "AttemptFinished": st.builds(
        AttemptFinished, rollout_id=an_id, attempt_id=an_id, attempt_number=st.integers(1, 100),
        worker_id=an_id, status=terminal, error=st.none() | errors, span_count=nonneg,
        reward=st.none() | finite, **common,
    ),
    "RolloutFinished": st.builds(
        RolloutFinished, rollout_id=an_id, status=st.sampled_from(RolloutStatus),
        attempt_id=st.none() | an_id, attempt_count=st.integers(0, 100),
        error=st.none() | errors, **common,
    ),
    "SpanRecorded": st.builds(
        SpanRecorded, rollout_id=an_id, attempt_id=an_id, sequence=nonneg, trace_id=hex32,
        span_id=hex16, parent_span_id=st.none() | hex16, name=text,
        kind=st.sampled_from(SpanKind), start_time_unix_nano=nonneg, end_time_unix_nano=nonneg,
        status=st.builds(SpanStatus, code=st.sampled_from(StatusCode), description=st.none() | text),
        attributes=attributes,
        events=st.lists(st.builds(SpanEvent, name=text, time_unix_nano=nonneg, attributes=attributes), max_size=2).map(tuple),
        links=st.lists(st.builds(SpanLink, trace_id=hex32, span_id=hex16, attributes=attributes), max_size=2).map(tuple),
        resource=attributes, scope_name=st.none() | text, **common,
    ),
    "ResourcesPublished": st.builds(
        ResourcesPublished, resources_id=an_id, version=nonneg,
        resources=st.dictionaries(text, st.one_of(
            st.builds(LLM, endpoint=ident, model=ident, sampling_parameters=st.dictionaries(text, finite, max_size=3)),
            st.builds(PromptTemplate, template=text, engine=st.sampled_from(TemplateEngine)),
            st.builds(Checkpoint, uri=ident, content_hash=st.text("0123456789abcdef", min_size=64, max_size=64).map(lambda h: f"sha256:{h}"), format=ident, base_uri=st.none() | ident, base_content_hash=st.none() | st.text("0123456789abcdef", min_size=64, max_size=64).map(lambda h: f"sha256:{h}")),
        ), max_size=3),
        published_by=st.none() | text, parent_resources_id=st.none() | an_id, metadata=metadata, **common,
    ),
    "WorkerHeartbeat": st.builds(
        WorkerHeartbeat, worker_id=an_id, role=st.sampled_from(WorkerRole),
        status=st.sampled_from(WorkerStatus), hostname=text, pid=st.integers(0, 2**31 - 1),
        current_rollouts=st.lists(an_id, max_size=3).map(tuple),
        counts=st.dictionaries(text, long, max_size=3), interval_seconds=st.floats(0.001, 1e6),
        **common,
    ),
    "AglRecordRevised": st.builds(
        AglRecordRevised, kind=st.sampled_from(AglRecordKind), partition_key=an_id, record_id=an_id,
        rollout_id=st.none() | an_id, revision=st.integers(1, 2**63 - 1), created_at=times,
        body_json=json_text, **common,
    ),
}  # fmt: skip

__all__ = ["EVENT_STRATEGIES", "AttemptStatus"]
