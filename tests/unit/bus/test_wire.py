"""Both framings: golden bytes, either framing decoded by any codec, and the schema-id cache
that keeps a consumer from asking the registry about every record (no registry here: a fake
client stands in; tests/integration/bus/test_schema_registry.py runs a real one)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agl_stream.bus import codec as codec_module
from agl_stream.bus.codec import Codec, DecodeError, Wire
from agl_stream.bus.registry_client import (
    COMPATIBILITY,
    NEGATIVE_SECONDS,
    RegistryClient,
    SchemaIds,
    UnknownId,
)
from agl_stream.bus.schema_registry import default_registry, record_name
from agl_stream.bus.wire import (
    Framing,
    FramingError,
    confluent_header,
    split,
    subject,
)
from agl_stream.events import EVENT_TYPES
from agl_stream.runtime.config import ConfigError, WireSettings, load
from tests.support.golden import GOLDEN_EVENTS
from tests.support.strategies import EVENT_STRATEGIES

TOPIC_OF = {"RolloutQueued": "agl.tasks", "SpanRecorded": "agl.spans"}


def test_confluent_header_is_magic_zero_and_a_big_endian_id() -> None:
    assert confluent_header(1) == b"\x00\x00\x00\x00\x01"
    assert confluent_header(0x01020304) == b"\x00\x01\x02\x03\x04"
    with pytest.raises(ValueError, match="between 0 and"):
        confluent_header(-1)
    with pytest.raises(ValueError, match="between 0 and"):
        confluent_header(2**31)


def test_split_tells_the_framings_apart() -> None:
    single = split(b"\xc3\x01" + bytes(range(8)) + b"body")
    assert (single.framing, single.fingerprint, single.body_start) == (
        Framing.SINGLE_OBJECT, bytes(range(8)), 10,
    )  # fmt: skip
    confluent = split(b"\x00\x00\x00\x01\x00body")
    assert (confluent.framing, confluent.schema_id, confluent.body_start) == (
        Framing.CONFLUENT, 256, 5,
    )  # fmt: skip
    for bad in (None, b"", b"\x00\x00\x01", b"\xc3\x01short", b'{"json": true}'):
        with pytest.raises(FramingError, match=r"single-object .* Confluent"):
            split(bad)


def test_subject_is_topic_and_record_name() -> None:
    version = default_registry().current["RolloutQueued"]
    assert record_name(version) == "ai.aglstream.RolloutQueued"
    assert subject("agl.tasks", record_name(version)) == "agl.tasks-ai.aglstream.RolloutQueued"


class FakeRegistry(RegistryClient):
    """The registry's answers from a dict; counts the lookups."""

    def __init__(self) -> None:
        super().__init__("http://registry.invalid/apis/ccompat/v7")
        self.by_id: dict[int, str] = {}
        self.subjects: dict[str, list[int]] = {}
        self.config: dict[str, str] = {}
        self.lookups: list[int] = []

    def register(self, subject_name: str, schema: Mapping[str, Any]) -> int:
        text = json.dumps(schema)
        for known_id, known in self.by_id.items():
            if json.loads(known) == schema:
                schema_id = known_id
                break
        else:
            schema_id = 100 + len(self.by_id)
            self.by_id[schema_id] = text
        self.subjects.setdefault(subject_name, []).append(schema_id)
        return schema_id

    def schema_text(self, schema_id: int) -> str | None:
        self.lookups.append(schema_id)
        return self.by_id.get(schema_id)

    def set_compatibility(self, subject_name: str, level: str) -> None:
        self.config[subject_name] = level


def ids_with(fake: FakeRegistry, clock: list[float] | None = None) -> SchemaIds:
    now = clock if clock is not None else [0.0]
    return SchemaIds(fake, default_registry(), TOPIC_OF, clock=lambda: now[0])


def test_a_confluent_writer_registers_once_and_frames_with_the_id() -> None:
    fake = FakeRegistry()
    codec = Codec(wire=Wire(Framing.CONFLUENT, ids_with(fake)))
    event = GOLDEN_EVENTS["RolloutQueued"]
    first, second = codec.encode(event), codec.encode(event)
    assert fake.subjects == {"agl.tasks-ai.aglstream.RolloutQueued": [100]}
    assert first[:5] == confluent_header(100) and first == second
    # Same Avro body as the single-object record of the same event.
    single = Codec(wire=Wire()).encode(event)
    assert first[5:] == single[10:]


@given(st.sampled_from(sorted(TOPIC_OF)), st.data())
def test_every_codec_reads_both_framings(event_type: str, data: st.DataObject) -> None:
    fake = FakeRegistry()
    ids = ids_with(fake)
    event = data.draw(EVENT_STRATEGIES[event_type])
    confluent = Codec(wire=Wire(Framing.CONFLUENT, ids))
    single = Codec(wire=Wire(Framing.SINGLE_OBJECT, ids_with(fake)))
    for writer in (confluent, single):
        for reader in (confluent, single):
            assert reader.decode(writer.encode(event)) == event
            assert reader.event_type_of(writer.encode(event)) == event_type


def test_a_hot_consumer_asks_the_registry_once_per_id() -> None:
    fake = FakeRegistry()
    record = Codec(wire=Wire(Framing.CONFLUENT, ids_with(fake))).encode(
        GOLDEN_EVENTS["SpanRecorded"]
    )
    reader = Codec(wire=Wire(Framing.SINGLE_OBJECT, ids_with(fake)))
    for _ in range(1000):
        reader.decode(record)
    assert fake.lookups == [100]


def test_an_unknown_id_is_refused_with_the_reason_and_asked_again_later() -> None:
    fake, clock = FakeRegistry(), [0.0]
    reader = Codec(wire=Wire(Framing.SINGLE_OBJECT, ids_with(fake, clock)))
    record = confluent_header(4242) + b"\x02"
    for _ in range(3):
        with pytest.raises(DecodeError) as info:
            reader.decode(record)
        assert info.value.kind == "unknown_schema"
        assert "unknown schema id 4242" in info.value.reason
        assert "does not know it" in info.value.reason
    assert fake.lookups == [4242]
    clock[0] += NEGATIVE_SECONDS + 1
    with pytest.raises(DecodeError):
        reader.decode(record)
    assert fake.lookups == [4242, 4242]


def test_a_registry_schema_that_is_not_ours_is_refused() -> None:
    fake = FakeRegistry()
    fake.by_id[7] = json.dumps({"type": "record", "name": "Invoice", "fields": []})
    found = ids_with(fake).writer_of(7)
    assert isinstance(found, UnknownId)
    assert "schema id 7 is not one of agl-stream's" in found.reason


def test_without_a_registry_a_confluent_record_is_refused_naming_the_setting() -> None:
    with pytest.raises(DecodeError) as info:
        Codec(wire=Wire()).decode(confluent_header(1) + b"\x02")
    assert info.value.kind == "unknown_schema"
    assert "AGL_STREAM_SCHEMA_REGISTRY_URL" in info.value.reason


def test_register_all_registers_every_release_and_sets_compatibility() -> None:
    fake = FakeRegistry()
    ids = ids_with(fake)
    done = ids.register_all()
    assert set(fake.config) == {
        "agl.tasks-ai.aglstream.RolloutQueued",
        "agl.spans-ai.aglstream.SpanRecorded",
    }
    assert set(fake.config.values()) == {COMPATIBILITY}
    releases = {release for _, release, _ in done}
    assert releases == {*default_registry().released, "current"}
    assert set(EVENT_TYPES) >= {name.rsplit(".", 1)[1] for name, _, _ in done}


def test_the_default_wire_maps_every_event_type_to_its_topic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AGL_STREAM_TOPIC_PREFIX", "p.")
    ids = codec_module.schema_ids("http://127.0.0.1:9/apis/ccompat/v7")
    version = default_registry().current["AttemptFinished"]
    assert ids.subject_of(version) == "p.rollouts-ai.aglstream.AttemptFinished"


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"AGL_STREAM_WIRE": "confluent"}, "AGL_STREAM_WIRE confluent needs"),
        ({"AGL_STREAM_WIRE": "avro"}, "Invalid setting AGL_STREAM_WIRE 'avro'"),
        ({"AGL_STREAM_SCHEMA_REGISTRY_URL": "host:1"}, "AGL_STREAM_SCHEMA_REGISTRY_URL"),
    ],
)
def test_bad_wire_settings_name_the_setting(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], words: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=words):
        load(WireSettings)
