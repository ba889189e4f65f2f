"""Clients in other languages on the real broker, with no Python in their path: the Java
example (Apache Kafka's kafka-clients, Apache Avro) and the Go example (franz-go,
hamba/avro), each reading the .avsc files under schemas/ only. Each queues tasks that a runner
runs, gives rewards that the projector and the trainer's assembler count, and reads the spans
of those rollouts exactly as Python reads them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.partitioner import DefaultPartitioner

from agl_stream.bus.codec import Codec
from agl_stream.bus.kafka import end_offsets
from agl_stream.bus.schema_registry import default_registry
from agl_stream.bus.streams import EVENT_TYPE_HEADER, Topics, read_records
from agl_stream.events import AttemptStatus, RolloutMode
from agl_stream.queries import ReadModel
from agl_stream.queries.dead_letters import read_dead_letters
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings
from agl_stream.training.trajectories import TRAINED_TOPICS, Assembler, LateRewardRule
from tests.support.clients import CLIENTS, Built
from tests.support.helpers import eventually
from tests.support.projection import caught_up, ends, projector_in_process
from tests.support.runs import runner_in_process, wait_terminal

TASKS = [{"spans": 3, "reward": 0.25}, {"spans": 1}, {"spans": 4, "reward": 0.5, "note": "é ✓"}]


@pytest.fixture(scope="module", params=sorted(CLIENTS))
def client(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The client, built once per run (skipped, saying why, only where its tools are missing)."""
    wanted = CLIENTS[request.param]
    missing = wanted.missing_tools()
    if missing is not None:
        pytest.skip(missing)
    built = wanted.build(tmp_path_factory.mktemp(f"{wanted.name}-client"))
    print(f"built the {wanted.name} client in {built.build_seconds:.1f} s")
    return built


async def test_a_client_queues_rewards_and_reads_spans_as_python_does(
    client: Built, kafka: KafkaSettings, database: DatabaseSettings, tmp_path: Path
) -> None:
    name = client.client.name
    # Its schemas are Python's: the same fingerprint for every current and released event.
    printed, _ = await client.run(kafka, "fingerprints")
    registry = default_registry()
    assert printed.splitlines() == [
        f"current {t} {v.fingerprint_hex}" for t, v in sorted(registry.current.items())
    ] + [
        f"{release} {t} {v.fingerprint_hex}"
        for release, versions in sorted(registry.released.items())
        for t, v in sorted(versions.items())
    ]

    # A task that is not JSON is refused with its line, before anything is queued.
    code, _, said = await client.attempt(kafka, "enqueue", stdin=b'{"spans": 1}\n{"spans": 2\n')
    assert code == 2 and "<stdin>:2: task input is not JSON" in said, said
    code, _, said = await client.attempt(kafka, "reward", "ro-1", "NaN")
    assert code == 2 and "a reward must be a finite number" in said, said

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t, ensure_ascii=False) + "\n" for t in TASKS))
    async with runner_in_process(kafka):
        printed, said = await client.run(kafka, "enqueue", "--file", str(tasks), "--mode", "train")
        ids = printed.split()
        assert len(ids) == len(TASKS) and f"queued {len(TASKS)} rollouts" in said
        done = await wait_terminal(kafka, ids, 60)
        rewarded = {ids[0]: 0.75, ids[2]: -0.5}
        pairs = [str(x) for pair in rewarded.items() for x in pair]
        printed, _ = await client.run(kafka, "reward", "--name", name, *pairs)
        assert len(printed.split()) == len(rewarded)
        printed, _ = await client.run(kafka, "spans", "--timeout", "30", *ids)

    for rollout_id, task in zip(ids, TASKS, strict=True):
        (queued,) = done.queued[rollout_id]
        assert json.loads(queued.input_json) == task
        assert (queued.mode, queued.attempt_number, queued.max_attempts) == (
            RolloutMode.TRAIN, 1, 1,
        )  # fmt: skip
        final = done.final(rollout_id)
        assert final is not None and final.status == "succeeded"
        (finished,) = done.finished[rollout_id]
        assert finished.status == AttemptStatus.SUCCEEDED
        assert finished.reward == task.get("reward", 1.0)
    await _keyed_as_python_keys(kafka, set(ids))

    # The spans it printed are the SpanRecorded records as Python decodes them.
    theirs = [json.loads(line) for line in printed.splitlines()]
    ours = await _span_datums(kafka, set(ids))
    assert {(s["attempt_id"], s["sequence"]): s for s in theirs} == ours
    counted = sum(f.span_count for rollout_id in ids for f in done.finished[rollout_id])
    assert len(theirs) == len(ours) == counted

    # Its rewards count: in the read model, and for the trainer (the late-reward rule).
    async with projector_in_process(kafka, database):
        wanted = await ends(kafka)
        await eventually(lambda: caught_up(database, wanted), 60, "the projector")
    async with ReadModel.open(database) as rm:
        for rollout_id, value in rewarded.items():
            (reward,) = await rm.rewards(rollout_id)
            assert (reward.name, reward.value, reward.source) == (name, value, f"{name}-client")
    trajectories = await _trajectories(kafka, LateRewardRule(name, wait_seconds=600))
    assert {t.rollout_id: t.reward for t in trajectories if t.reward_from == "late"} == rewarded
    assert await read_dead_letters(kafka, 100) == []


async def _keyed_as_python_keys(kafka: KafkaSettings, ids: set[str]) -> None:
    """The tasks topic holds its tasks alone (the refused input queued nothing), each once, on
    the partition aiokafka's default partitioner picks for its key (murmur2, as Kafka's), with
    the event-type header agl-stream's producers set."""
    partitions = list(range(Topics(kafka).specs["tasks"].partitions))
    chooser = DefaultPartitioner()
    keys = []
    async for record in _records(kafka, "tasks"):
        assert record.partition == chooser(record.key, partitions, partitions)
        assert dict(record.headers)[EVENT_TYPE_HEADER] == b"RolloutQueued"
        keys.append(record.key.decode())
    assert sorted(keys) == sorted(ids)


async def _span_datums(kafka: KafkaSettings, ids: set[str]) -> dict[tuple[str, int], Any]:
    codec = Codec()
    out = {}
    async for record in _records(kafka, "spans"):
        _, datum = codec.decode_datum(record.value, plain=True)
        if datum["rollout_id"] in ids:
            out[(datum["attempt_id"], datum["sequence"])] = json.loads(json.dumps(datum))
    return out


async def _trajectories(kafka: KafkaSettings, rule: LateRewardRule) -> list[Any]:
    """What the trainer's assembler makes of the topics, with this late-reward rule."""
    assembler = Assembler(late_reward=rule)
    codec = Codec()
    for short in TRAINED_TOPICS:  # tasks, rollouts (with the rewards), then spans
        async for record in _records(kafka, short):
            event = codec.decode(record.value)
            assembler.add((short, record.partition), record.offset, event, record.timestamp)
    return assembler.complete()


async def _records(kafka: KafkaSettings, short: str) -> Any:
    topics = Topics(kafka)
    tps = [TopicPartition(topics.name(short), p) for p in range(topics.specs[short].partitions)]
    last = await end_offsets(kafka, tps)
    async for record in read_records(kafka, dict.fromkeys(tps, 0), last):
        yield record
