"""Schema evolution: the committed schemas stay compatible, both ways, with every released
set; and the checker really rejects the changes Avro cannot resolve."""

from __future__ import annotations

import copy
import io
from typing import Any

import fastavro
import pytest

from agl_stream.bus.codec import Codec
from agl_stream.bus.schema_compat import compatibility_errors, resolution_errors
from agl_stream.bus.schema_registry import (
    SchemaRegistry,
    default_registry,
    load_current,
    release_key,
)
from tests.support.golden import GOLDEN_EVENTS

REGISTRY = default_registry()
CURRENT = {k: dict(v.schema) for k, v in REGISTRY.current.items()}


def test_there_is_a_released_set() -> None:
    assert REGISTRY.latest_release() is not None


@pytest.mark.parametrize("release", sorted(REGISTRY.released, key=release_key))
def test_current_schemas_are_compatible_with_release(release: str) -> None:
    released = {k: dict(v.schema) for k, v in REGISTRY.released[release].items()}
    assert compatibility_errors(released, CURRENT) == []


@pytest.mark.parametrize("release", sorted(REGISTRY.released, key=release_key))
def test_bytes_written_by_a_release_decode_today(release: str) -> None:
    codec = Codec()
    for event_type, version in REGISTRY.released[release].items():
        datum = GOLDEN_EVENTS[event_type].model_dump(mode="python")
        keep = {f["name"] for f in version.schema["fields"]}
        buffer = io.BytesIO()
        fastavro.schemaless_writer(
            buffer, version.parsed, {k: v for k, v in datum.items() if k in keep}
        )
        decoded = codec.decode(b"\xc3\x01" + version.fingerprint + buffer.getvalue())
        assert decoded.event_id == GOLDEN_EVENTS[event_type].event_id


def _field(schema: dict[str, Any], name: str) -> dict[str, Any]:
    return next(f for f in schema["fields"] if f["name"] == name)


def _changed(event: str) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    new = copy.deepcopy(CURRENT)
    return new, new[event]


def test_adding_an_optional_field_with_default_is_compatible() -> None:
    new, schema = _changed("AttemptStarted")
    schema["fields"].append({"name": "host", "type": ["null", "string"], "default": None})
    assert compatibility_errors(CURRENT, new) == []


def test_adding_a_required_field_breaks_new_readers() -> None:
    new, schema = _changed("AttemptStarted")
    schema["fields"].append({"name": "host", "type": "string"})
    errors = compatibility_errors(CURRENT, new)
    assert errors == [
        "new readers of old data: AttemptStarted.host: reader field is missing from the writer "
        "and has no default"
    ]


def test_removing_a_required_field_breaks_old_readers() -> None:
    new, schema = _changed("AttemptStarted")
    schema["fields"] = [f for f in schema["fields"] if f["name"] != "worker_id"]
    errors = compatibility_errors(CURRENT, new)
    assert any("old readers of new data: AttemptStarted.worker_id" in e for e in errors)


def test_narrowing_a_type_breaks() -> None:
    new, schema = _changed("SpanRecorded")
    _field(schema, "sequence")["type"] = "int"
    assert any("long cannot be read as int" in e for e in compatibility_errors(CURRENT, new))


def test_widening_a_type_breaks_only_old_readers() -> None:
    new, schema = _changed("WorkerHeartbeat")
    _field(schema, "pid")["type"] = "long"
    errors = compatibility_errors(CURRENT, new)
    assert errors and all(e.startswith("old readers of new data") for e in errors)


def test_new_enum_symbol_needs_a_reader_default() -> None:
    new, schema = _changed("RolloutFinished")
    status = _field(schema, "status")["type"]
    status["symbols"].append("abandoned")
    assert compatibility_errors(CURRENT, new) == []  # old readers fall back to "failed"
    del status["default"]
    old_without_default = copy.deepcopy(CURRENT)
    del _field(old_without_default["RolloutFinished"], "status")["type"]["default"]
    errors = compatibility_errors(old_without_default, new)
    assert any("abandoned" in e for e in errors)


def test_renaming_a_record_breaks_unless_aliased() -> None:
    renamed = copy.deepcopy(CURRENT["RolloutCancelled"])
    renamed["name"] = "ai.aglstream.RolloutAborted"
    assert resolution_errors(CURRENT["RolloutCancelled"], renamed)
    renamed["aliases"] = ["ai.aglstream.RolloutCancelled"]
    assert resolution_errors(CURRENT["RolloutCancelled"], renamed) == []


def test_removing_an_event_type_breaks() -> None:
    new = {k: v for k, v in CURRENT.items() if k != "RolloutCancelled"}
    assert compatibility_errors(CURRENT, new) == [
        "RolloutCancelled: removed, but released data of this type must stay readable"
    ]


def test_checker_agrees_with_fastavro_on_an_accepted_change() -> None:
    """What the checker accepts, fastavro can really resolve, both ways."""
    new, schema = _changed("AttemptStarted")
    schema["fields"].append({"name": "host", "type": ["null", "string"], "default": None})
    assert compatibility_errors(CURRENT, new) == []
    old_parsed = fastavro.parse_schema(copy.deepcopy(CURRENT["AttemptStarted"]))
    new_parsed = fastavro.parse_schema(copy.deepcopy(schema))
    datum = GOLDEN_EVENTS["AttemptStarted"].model_dump(mode="python")
    for writer, reader, value in (
        (old_parsed, new_parsed, datum),
        (new_parsed, old_parsed, {**datum, "host": "h"}),
    ):
        buffer = io.BytesIO()
        fastavro.schemaless_writer(buffer, writer, value)
        buffer.seek(0)
        assert fastavro.schemaless_reader(buffer, writer, reader)["rollout_id"] == "ro-1"


def test_registry_knows_every_fingerprint() -> None:
    registry = SchemaRegistry(current=load_current(), released=REGISTRY.released)
    for version in registry.current.values():
        assert registry.by_fingerprint[version.fingerprint] is version


def test_readers_of_the_first_release_meet_the_new_events_safely() -> None:
    """RewardRecorded is new on the rollouts topic: a consumer of release 0.1.0 dead-letters
    it as an unknown schema (and goes on), and reads an AttemptStarted with a task as one
    without (upgrade consumers before anything records rewards: the README says so)."""
    from agl_stream.events import AttemptStarted, AttemptTask, RolloutMode

    old = REGISTRY.released["0.1.0"]
    reward = Codec().encode(GOLDEN_EVENTS["RewardRecorded"])
    # What the old codec looks a fingerprint up in (a miss: DecodeError "unknown_schema").
    assert SchemaRegistry(current=old, released={}).by_fingerprint.get(reward[2:10]) is None
    with_task = AttemptStarted.model_validate(
        {
            **GOLDEN_EVENTS["AttemptStarted"].model_dump(),
            "task": AttemptTask(input_json="{}", mode=RolloutMode.TRAIN),
        }
    )
    data = Codec().encode(with_task)
    version = REGISTRY.current["AttemptStarted"]
    buffer = io.BytesIO(data[10:])
    datum = fastavro.schemaless_reader(buffer, version.parsed, old["AttemptStarted"].parsed)
    assert "task" not in datum and datum["rollout_id"] == "ro-1"
