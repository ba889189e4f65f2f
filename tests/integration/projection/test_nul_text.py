"""A NUL in any text an event carries (an LLM's output, an exception's message) reaches the
read model as U+FFFD, the one thing PostgreSQL's text and jsonb cannot hold; the batch it is
in is written, not refused again at every restart."""

from __future__ import annotations

from agl_stream.bus.codec import Codec
from agl_stream.events import (
    AttemptFinished,
    AttemptStarted,
    AttemptStatus,
    ErrorInfo,
    RolloutCancelled,
    RolloutMode,
    RolloutQueued,
    SpanRecorded,
)
from agl_stream.projection.fold import keys, project
from agl_stream.projection.span_record import span_row_from_datum, span_tuple_from_record
from agl_stream.projection.store import ProjectionStore, active_read_model, connect
from agl_stream.queries import ReadModel
from agl_stream.runtime.config import DatabaseSettings
from tests.support.golden import GOLDEN_EVENTS
from tests.unit.projection.test_span_record import plain

NUL, R = "\x00", "\ufffd"


async def test_nul_characters_are_stored_as_replacement_characters(
    database: DatabaseSettings,
) -> None:
    rollout_id, attempt_id = "ro-nul", "at-1"
    events = [
        RolloutQueued(
            rollout_id=rollout_id, attempt_number=1, input_json='{"q": "a\\u0000b"}',
            mode=RolloutMode.TRAIN, metadata={f"k{NUL}": f"v{NUL}"},
        ),
        AttemptStarted(
            rollout_id=rollout_id, attempt_id=attempt_id, attempt_number=1, worker_id="w",
        ),
        AttemptFinished(
            rollout_id=rollout_id, attempt_id=attempt_id, attempt_number=1, worker_id="w",
            status=AttemptStatus.FAILED, span_count=1,
            error=ErrorInfo(type="ValueError", message=f"boom{NUL}"),
        ),
        RolloutCancelled(rollout_id=rollout_id, reason=f"why{NUL}"),
    ]  # fmt: skip
    golden = GOLDEN_EVENTS["SpanRecorded"]
    assert isinstance(golden, SpanRecorded)
    span = golden.model_copy(
        update={
            "rollout_id": rollout_id, "attempt_id": attempt_id, "sequence": 0,
            "name": f"n{NUL}", "attributes": {f"a{NUL}": [f"x{NUL}", 1]},
        }
    )  # fmt: skip
    codec = Codec()
    record = codec.encode(span)
    assert span_tuple_from_record(record) is None, "text with a NUL is the general path's"
    span_row = span_row_from_datum(plain(record))

    conn = await connect(database.asyncpg_dsn)
    try:
        store = ProjectionStore(conn, await active_read_model(conn))
        async with conn.transaction():
            changes = project(events, await store.load(keys(events)))
            changes.spans.append(span_row)
            await store.write(changes)
    finally:
        await conn.close()

    async with ReadModel.open(database) as rm:
        rollout = await rm.rollout(rollout_id)
        assert rollout.input == {"q": f"a{R}b"}
        assert rollout.metadata == {f"k{R}": f"v{R}"}
        assert rollout.cancel_reason == f"why{R}"
        assert rollout.error is not None and rollout.error["message"] == f"boom{R}"
        (attempt,) = await rm.attempts(rollout_id)
        assert attempt.worker_id == "w"  # ids hold no NUL: the id rule refuses one
        (stored,) = await rm.spans(rollout_id)
        assert stored.name == f"n{R}"
        assert stored.attributes == {f"a{R}": [f"x{R}", 1]}
