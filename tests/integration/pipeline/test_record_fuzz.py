"""Generated records, valid, hostile and garbage, produced raw to every event topic while a
runner, a projector and a trainer run as processes: none of them stops, every record the
codec refuses is dead-lettered by the projector, the projection reaches the end of every
partition (so every record was projected or dead-lettered), and a replay builds the same
read model. `--record-fuzz-size long` sends more."""

from __future__ import annotations

import random
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from agl_stream.bus.codec import Codec, DecodeError
from agl_stream.bus.kafka import producer
from agl_stream.bus.streams import EVENT_TYPE_HEADER, Topics
from agl_stream.bus.topic_spec import load_topic_specs
from agl_stream.events import EVENT_TYPES, Event
from agl_stream.events.ids import id_problem
from agl_stream.projection.projector import projector_group
from agl_stream.queries import ReadModel
from agl_stream.queries.dead_letters import read_dead_letters
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings
from tests.support.chaos import Crew
from tests.support.helpers import eventually, examples
from tests.support.projection import assert_equals_replay, caught_up, ends
from tests.support.strategies import EVENT_STRATEGIES

SIZES = {"ci": 1500, "long": 20_000}
ROLES = ("projector", "runner", "trainer")
# Ids the id rule refuses, and values a careless producer writes (model_construct skips the
# model's checks; the bytes are valid Avro all the same).
HOSTILE_IDS = ("", "\x00", "ro-\x00x", "a\nb", "\u200b", "\x7f", "x" * 257, "r" * 10_005)
ID_FIELDS = ("rollout_id", "attempt_id", "worker_id", "resources_id", "record_id")


def _hostile(event: Event, rng: random.Random) -> Event | None:
    """The event with one of its ids made hostile, or a JSON text with a lone surrogate;
    None when it has neither."""
    fields = [f for f in ID_FIELDS if getattr(event, f, None) is not None]
    if "input_json" in type(event).model_fields and rng.random() < 0.3:
        return type(event).model_construct(
            **{**dict(event), "input_json": '{"q": "\\ud800 and \\u0000"}'}
        )
    if not fields:
        return None
    return type(event).model_construct(
        **{**dict(event), rng.choice(fields): rng.choice(HOSTILE_IDS)}
    )


def _garbage(rng: random.Random, valid: bytes) -> bytes:
    choice = rng.randrange(4)
    if choice == 0:
        return rng.randbytes(rng.randrange(1, 200))
    if choice == 1:
        return valid[: rng.randrange(len(valid))]
    if choice == 2:  # a flipped byte in the body (the header is left to name the schema)
        data = bytearray(valid)
        at = rng.randrange(10, len(data)) if len(data) > 10 else 0
        data[at] ^= 1 << rng.randrange(8)
        return bytes(data)
    return valid + rng.randbytes(rng.randrange(1, 8))  # trailing bytes


def _records(count: int, rng: random.Random) -> list[tuple[str, bytes, bytes | None]]:
    """(short topic, key, value) of `count` records over every event topic."""
    codec, specs = Codec(), load_topic_specs()
    by_topic = {short: spec.events for short, spec in specs.items() if spec.events}
    out: list[tuple[str, bytes, bytes | None]] = []
    per_type = Counter(
        rng.choice([t for ts in by_topic.values() for t in ts]) for _ in range(count)
    )
    generated = {t: examples(EVENT_STRATEGIES[t], n) for t, n in per_type.items()}
    for event_type, events in generated.items():
        short = next(s for s, ts in by_topic.items() if event_type in ts)
        for event in events:
            roll = rng.random()
            key = str(getattr(event, EVENT_TYPES[event_type].key_field)).encode()[:300]
            if roll < 0.6:
                out.append((short, key, codec.encode(event)))
            elif roll < 0.8:
                hostile = _hostile(event, rng) or event
                out.append((short, key, codec.encode(hostile)))
            elif roll < 0.97:
                out.append((short, key, _garbage(rng, codec.encode(event))))
            else:
                out.append((short, key, None))  # a tombstone
    rng.shuffle(out)
    return out


@pytest.fixture
def record_fuzz_size(request: pytest.FixtureRequest) -> int:
    return SIZES[str(request.config.getoption("--record-fuzz-size"))]


async def test_generated_records_on_every_topic_stop_no_worker(
    kafka: KafkaSettings, database: DatabaseSettings, tmp_path: Path, record_fuzz_size: int
) -> None:
    rng = random.Random(20261127)
    # Any agent will do: the records are the test.
    crew = Crew(
        kafka, database, tmp_path / "logs", tmp_path / "checkpoints", "tests.support.agents:behave"
    )
    records = _records(record_fuzz_size, rng)
    for role in ROLES:
        await crew.start(role, role)

    async def all_up() -> bool:  # each has heartbeated: it is past its start-up
        async with ReadModel.open(database) as rm:
            return set(ROLES) <= {w.worker_id for w in await rm.workers()}

    await eventually(all_up, 120, "the workers' first heartbeats")
    topics = Topics(kafka)
    sent: dict[tuple[str, int, int], bytes | None] = {}
    try:
        async with producer(kafka) as prod:
            futures = []
            for short, key, value in records:
                headers = [(EVENT_TYPE_HEADER, b"?"), ("fuzz", uuid.uuid4().bytes)]
                futures.append(
                    (value, await prod.send(topics.name(short), value, key=key, headers=headers))
                )
            for value, future in futures:
                meta = await future
                sent[(meta.topic, meta.partition, meta.offset)] = value
        expected = await ends(kafka)

        async def projected() -> bool:
            dead = [m.name for m in crew.members.values() if m.process.returncode is not None]
            assert not dead, f"{dead} stopped: {_tails(crew)}"
            return await caught_up(database, expected)

        await eventually(projected, 240, "the projection to reach the end of every partition")
        codec = Codec()
        undecodable = set()
        for where, value in sent.items():
            try:
                codec.decode(value)
            except DecodeError:
                undecodable.add(where)
        group = projector_group(kafka.topic_prefix)
        lettered = {
            (d.source_topic, d.source_partition, d.source_offset)
            for d in await read_dead_letters(kafka, 10 * len(sent))
            if d.consumer == group
        }
        missing = sorted(undecodable - lettered)
        assert not missing, f"{len(missing)} refused records not dead-lettered, e.g. {missing[:3]}"
        assert len(undecodable) > record_fuzz_size // 4  # the mix really holds bad records
        for role in ("runner", "trainer", "projector"):
            await crew.stop(role)
        assert crew.died == [], crew.died
    finally:
        await crew.stop_all()
    await assert_equals_replay(kafka, database)


def _tails(crew: Crew) -> dict[str, Any]:
    return {m.name: m.log.read_text(errors="replace")[-2000:] for m in crew.members.values()}


def test_the_hostile_ids_are_what_the_id_rule_refuses() -> None:
    assert all(id_problem(value) is not None for value in HOSTILE_IDS)
