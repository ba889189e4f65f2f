"""The one id rule (events/ids.py): where it refuses, the sentence names the field; every event
model applies it on building and on decoding, so a record holding a bad id is dead-lettered."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agl_stream.bus.codec import Codec, DecodeError
from agl_stream.events import AttemptStarted, RolloutMode, RolloutQueued, WorkerHeartbeat
from agl_stream.events.ids import MAX_ID_LENGTH, id_problem, require_id


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("", "must not be empty"),
        ("ro-nul-\x00x", "character 8 is U+0000"),
        ("a\nb", "U+000A"),
        ("zero\u200bwidth", "U+200B"),
        ("x" * (MAX_ID_LENGTH + 1), f"at most {MAX_ID_LENGTH} characters long (it has 257)"),
        (7, "must be text, not int"),
    ],
)
def test_what_is_not_an_id_is_said_in_a_sentence(value: object, says: str) -> None:
    problem = id_problem(value)
    assert problem is not None and says in problem
    with pytest.raises(ValueError, match=r"^rollout_id must"):
        require_id("rollout_id", value)


@pytest.mark.parametrize("value", ["ro-1", "a b", "é✓漢字", "x" * MAX_ID_LENGTH, "🙂" * 10])
def test_printable_ids_up_to_the_limit_are_ids(value: str) -> None:
    assert id_problem(value) is None
    assert require_id("rollout_id", value) == value


def test_every_event_refuses_a_bad_id_by_its_field_name() -> None:
    with pytest.raises(ValidationError, match="rollout_id"):
        RolloutQueued(rollout_id="a\x00", attempt_number=1, input_json="{}", mode=RolloutMode.TRAIN)
    with pytest.raises(ValidationError, match="worker_id"):
        AttemptStarted(rollout_id="r", attempt_id="a", attempt_number=1, worker_id="w" * 300)
    with pytest.raises(ValidationError, match="current_rollouts"):
        WorkerHeartbeat.model_validate(
            {"worker_id": "w", "role": "runner", "status": "idle", "hostname": "h", "pid": 1,
             "interval_seconds": 5, "current_rollouts": ["ok", "bad\x07"]}
        )  # fmt: skip


def test_a_record_written_with_a_bad_id_does_not_decode() -> None:
    codec = Codec()
    good = RolloutQueued(rollout_id="ro-1", attempt_number=1, input_json="{}", mode="train")
    # Written by a producer that does not check (another language, an older agl-stream):
    # the same bytes with the id replaced by one holding a NUL of the same length.
    data = codec.encode(good).replace(b"ro-1", b"r\x00-1")
    with pytest.raises(DecodeError) as caught:
        codec.decode(data)
    assert caught.value.kind == "invalid"
    assert "rollout_id" in caught.value.reason
