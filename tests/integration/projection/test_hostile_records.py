"""Records a hostile or careless producer puts on the topics never stop the projector: ids the
id rule refuses (a NUL, 10,005 characters), a value the read model cannot hold, a reward from
the far future. Each is dead-lettered with its reason, everything around it is projected, the
projector keeps running, and a replay builds the same read model."""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

from aiokafka import TopicPartition

from agl_stream.bus.codec import Codec
from agl_stream.bus.kafka import consumer, producer
from agl_stream.bus.streams import EVENT_TYPE_HEADER, Topics
from agl_stream.events import (
    AttemptFinished,
    AttemptStarted,
    AttemptStatus,
    Event,
    RewardRecorded,
    RolloutMode,
    RolloutQueued,
)
from agl_stream.queries import ReadModel
from agl_stream.queries.dead_letters import read_dead_letters
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings, child_environment
from tests.support.helpers import eventually, invoke_cli
from tests.support.projection import assert_equals_replay, caught_up, ends, projector_in_process


def _queued(rollout_id: str, input_json: str = '{"q": 1}') -> RolloutQueued:
    # model_construct: what a producer that does not check (another language, an older
    # release) writes; the bytes are valid Avro all the same.
    return RolloutQueued.model_construct(
        **{
            **RolloutQueued(rollout_id="x", attempt_number=1, input_json="{}", mode="train")
            .model_dump(),
            "rollout_id": rollout_id, "input_json": input_json, "mode": RolloutMode.TRAIN,
        }
    )  # fmt: skip


async def _produce(kafka: KafkaSettings, short: str, events: list[Event]) -> None:
    topics, codec = Topics(kafka), Codec()
    async with producer(kafka) as prod:
        for event in events:
            await prod.send_and_wait(
                topics.name(short),
                codec.encode(event),
                key=str(getattr(event, "rollout_id", "k"))[:200].encode(errors="replace"),
                headers=[(EVENT_TYPE_HEADER, event.type_name().encode())],
            )


async def test_no_record_stops_the_projector_and_each_bad_one_is_dead_lettered(
    kafka: KafkaSettings, database: DatabaseSettings
) -> None:
    nul_id, long_id = "ro-nul-\x00x", "r" * 10_005
    started = AttemptStarted(rollout_id="ro-ok", attempt_id="a1", attempt_number=1, worker_id="w")
    # span_count is an Avro long and a 32-bit column: the database refuses this one.
    too_many = AttemptFinished(
        rollout_id="ro-ok", attempt_id="a1", attempt_number=1, worker_id="w",
        status=AttemptStatus.SUCCEEDED, span_count=2**40,
    )  # fmt: skip
    future = RewardRecorded.model_construct(
        **{
            **RewardRecorded(rollout_id="ro-ok", value=1.0).model_dump(),
            "occurred_at": datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC), "value": -100.0,
        }
    )  # fmt: skip
    async with projector_in_process(kafka, database):
        await _produce(kafka, "tasks", [_queued(nul_id), _queued(long_id)])
        await _produce(
            kafka, "tasks", [_queued("ro-ok"), _queued("ro-surrogate", '{"q": "a\\ud800"}')]
        )
        await _produce(kafka, "rollouts", [started, too_many, future])
        await _produce(kafka, "tasks", [_queued("ro-after")])
        expected = await ends(kafka)

        async def projected() -> bool:
            return await caught_up(database, expected)

        await eventually(projected, 60, "the projection to reach every partition's end")
        async with ReadModel.open(database) as rm:
            assert {r.rollout_id for r in (await rm.rollouts(limit=50)).items} == {
                "ro-ok", "ro-surrogate", "ro-after",
            }  # fmt: skip
            assert (await rm.rollout("ro-surrogate")).input == {"q": "a\ufffd"}
            (attempt,) = await rm.attempts("ro-ok")
            assert attempt.status == "running"  # its AttemptFinished is the refused record
            assert await rm.rewards(rollout_id="ro-ok") == []
        # Dead letters are sent at least once (a record read again after a rebalance is
        # dead-lettered again, under the same key): one each, counted by their origin.
        letters = {
            (x.source_topic, x.source_partition, x.source_offset): x
            for x in await read_dead_letters(kafka, 20)
        }
        assert len(letters) == 4
        by_kind: dict[str, list[str]] = {}
        for letter in letters.values():
            by_kind.setdefault(letter.kind, []).append(letter.reason)
        assert sorted(by_kind) == ["future_reward", "invalid", "unprojectable"], by_kind
        assert len(by_kind["invalid"]) == 2
        assert all("rollout_id" in reason for reason in by_kind["invalid"])
        assert any("U+0000" in reason for reason in by_kind["invalid"])
        assert any("at most 256 characters" in reason for reason in by_kind["invalid"])
        assert "span_count" in by_kind["unprojectable"][0] or "int32" in by_kind["unprojectable"][0]
        assert "9999-12-31" in by_kind["future_reward"][0]
        # Still running: a record after all that is projected too.
        await _produce(kafka, "tasks", [_queued("ro-later")])

        async def later() -> bool:
            async with ReadModel.open(database) as rm:
                page = await rm.rollouts(limit=50)
            return "ro-later" in {r.rollout_id for r in page.items}

        await eventually(later, 60, "a rollout queued after the bad records")
    await assert_equals_replay(kafka, database)


async def test_a_rollout_id_with_a_nul_is_refused_where_it_enters(
    kafka: KafkaSettings, database: DatabaseSettings, tmp_path: Path
) -> None:
    """The issue's reproduction: `agl-stream enqueue` of a JSONL line whose id holds a NUL."""
    tasks = tmp_path / "nul.jsonl"
    tasks.write_text('{"rollout_id": "ro-nul-\\u0000x", "input": {"q": 1}}\n')
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agl_stream.cli.main", "enqueue", str(tasks),
        env=child_environment(kafka, database),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 120)
    said = (out + err).decode()
    assert process.returncode != 0, said
    assert "Traceback" not in said
    assert "rollout_id" in said and "U+0000" in said, said
    assert f"{tasks}:1" in said, said
    assert json.dumps(said)  # printable as it is


async def test_lag_and_status_show_partitions_the_projection_never_took(
    kafka: KafkaSettings, database: DatabaseSettings
) -> None:
    """Records no projector has taken yet: `query lag` lists their partition (behind by all
    it holds), and `status` shows the projection behind, waiting for a projector."""
    await _produce(kafka, "tasks", [_queued("ro-waiting")])
    where = (
        "--bootstrap-servers", kafka.bootstrap_servers, "--topic-prefix", kafka.topic_prefix,
        "--database-url", database.database_url.get_secret_value(),
    )  # fmt: skip
    lag = await invoke_cli(*where, "query", "lag", "--json")
    assert lag.exit_code == 0, lag.output
    behind = [p for p in json.loads(lag.output) if p["lag"]]
    assert [(p["topic"], p["next_offset"], p["lag"]) for p in behind] == [
        (f"{kafka.topic_prefix}tasks", 0, 1)
    ]
    # A group that committed on this deployment's topics is listed; groups of other
    # deployments on the shared broker (every other test's) are not.
    tasks = TopicPartition(f"{kafka.topic_prefix}tasks", 0)
    async with consumer(kafka, group_id=f"{kafka.topic_prefix}reader") as reader:
        reader.assign([tasks])
        await reader.commit({tasks: 0})
    status = await invoke_cli(*where, "status")
    assert status.exit_code == 0, status.output  # none is running: nothing is stuck
    assert "projection (the read model)" in status.output
    assert "1 records wait for a projector: none is running." in status.output
    report = json.loads((await invoke_cli(*where, "status", "--json")).output)
    assert [(g["group"], g["lag"]) for g in report["groups"]] == [
        (f"{kafka.topic_prefix}reader", {f"{kafka.topic_prefix}tasks": 1})
    ]
