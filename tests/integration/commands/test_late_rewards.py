"""Late and external rewards through the real broker and database: from the CLI, Python and
the token-protected HTTP endpoint into the read model (queries and CLI), and rewards for an
unknown rollout or attempt, or given before any attempt, into the dead-letter topic."""

from __future__ import annotations

import io
import json
import math

import aiohttp
import fastavro

from agl_stream.bus.kafka import producer
from agl_stream.bus.schema_registry import default_registry
from agl_stream.bus.streams import EventPublisher, Topics
from agl_stream.cli.dlq import read_dead_letters
from agl_stream.commands.rewards import RewardSender
from agl_stream.events import AttemptFinished, AttemptStarted, AttemptStatus
from agl_stream.gateway.proxy import Gateway
from agl_stream.queries import ReadModel
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings
from tests.support.golden import GOLDEN_EVENTS
from tests.support.helpers import eventually, invoke_cli
from tests.support.projection import assert_equals_replay, caught_up, ends, projector_in_process

TOKEN = "s3cret-token-of-16+"


def _attempt(rollout_id: str, attempt_id: str) -> list[AttemptStarted | AttemptFinished]:
    return [
        AttemptStarted(rollout_id=rollout_id, attempt_id=attempt_id, attempt_number=1,
                       worker_id="w"),
        AttemptFinished(rollout_id=rollout_id, attempt_id=attempt_id, attempt_number=1,
                        worker_id="w", status=AttemptStatus.SUCCEEDED, span_count=0),
    ]  # fmt: skip


async def test_rewards_from_every_producer_are_joined_or_dead_lettered(
    kafka: KafkaSettings, database: DatabaseSettings
) -> None:
    broker = ("--bootstrap-servers", kafka.bootstrap_servers, "--topic-prefix", kafka.topic_prefix)
    url = ("--database-url", database.database_url.get_secret_value())
    async with producer(kafka) as prod, RewardSender(kafka) as rewards:
        publisher = EventPublisher(prod, Topics(kafka))
        # r-early's reward is on the broker before its attempt: unknown when it was given.
        await rewards.send("r-early", 1.0, source="test")
        await publisher.publish_many("rollouts", [*_attempt("r1", "a1"), *_attempt("r-early", "e")])
        await rewards.send("r1", 0.5, name="ci", attempt_id="a1", source="python")
        await rewards.send("r1", 1.0, name="thumbs", attempt_id="not-an-attempt")
        await rewards.send("nobody", 1.0)
        # Another language's producer writes a NaN: valid Avro, not a valid reward.
        nan = GOLDEN_EVENTS["RewardRecorded"].model_dump(mode="python") | {"value": math.nan}
        schema = default_registry().current["RewardRecorded"]
        body = io.BytesIO()
        fastavro.schemaless_writer(body, schema.parsed, {**nan, "rollout_id": "r1"})
        raw = b"\xc3\x01" + schema.fingerprint + body.getvalue()
        await prod.send_and_wait(kafka.topic("rollouts"), raw, key=b"r1")
        cli = await invoke_cli(*broker, "reward", "r1", "-1", "--name", "thumbs",
                               "--call", "00f067aa0ba902b7", "--metadata", "user=u9")  # fmt: skip
        assert cli.exit_code == 0, cli.output
        assert "recorded" in cli.output
        bad = await invoke_cli(*broker, "reward", "r1", "inf")
        assert bad.exit_code == 2 and "not a finite number" in bad.output

        gateway = Gateway("http://127.0.0.1:9/v1", publisher, reward_token=TOKEN)
        base = await gateway.start()
        try:
            async with aiohttp.ClientSession() as http:
                body = [
                    {"rollout_id": "r1", "value": 2, "name": "label", "source": "labeller",
                     "event_id": "0b5c2a8e-8a43-4c3f-9d7e-2f1e4c6b7a90"},
                ]  # fmt: skip
                async with http.post(f"{base}/rewards", json=body) as answer:
                    assert answer.status == 401
                wrong = {"Authorization": "Bearer nope"}
                async with http.post(f"{base}/rewards", json=body, headers=wrong) as answer:
                    assert answer.status == 403
                auth = {"Authorization": f"Bearer {TOKEN}"}
                nan = b'{"rollout_id": "r1", "value": NaN}'
                async with http.post(f"{base}/rewards", data=nan, headers=auth) as answer:
                    assert answer.status == 400
                    assert "finite" in (await answer.json())["error"]["message"]
                for _ in range(2):  # sent again after a lost answer: the same reward
                    async with http.post(f"{base}/rewards", json=body, headers=auth) as answer:
                        assert answer.status == 200, await answer.text()
                        assert (await answer.json())["recorded"] == 1
        finally:
            await gateway.stop()

    async with projector_in_process(kafka, database):
        wanted = await ends(kafka)
        await eventually(lambda: caught_up(database, wanted), 60, "the projector")
    async with ReadModel.open(database) as rm:
        rows = await rm.rewards("r1")
        assert len(rows) == 3  # the label sent twice with its event id is one reward
        got = {(r.name, r.value, r.attempt_id, r.span_id, r.source) for r in rows}
        assert got == {
            ("ci", 0.5, "a1", None, "python"),
            ("thumbs", -1.0, None, "00f067aa0ba902b7", "cli"),
            ("label", 2.0, None, None, "labeller"),
        }
        assert [r.value for r in await rm.rewards(name="label")] == [2.0]
    shown = await invoke_cli(*url, "query", "rewards", "r1", "--name", "thumbs", "--json")
    assert shown.exit_code == 0, shown.output
    assert [r["metadata"] for r in json.loads(shown.output)] == [{"user": "u9"}]
    table = await invoke_cli(*url, "query", "attempts", "r1")
    assert table.exit_code == 0, table.output
    assert all(w in table.output for w in ("late", "ci=0.5", "label=", "thumbs")), table.output
    missing = await invoke_cli(*url, "query", "rewards", "nobody")
    assert missing.exit_code == 1 and "no rollout 'nobody'" in missing.output

    letters = await read_dead_letters(kafka, 100)
    # One letter per record (a batch read again after a rebalance dead-letters it again).
    letters = list(
        {
            (d.source_partition, d.source_offset): d
            for d in letters
            if d.source_topic == kafka.topic("rollouts")
        }.values()
    )
    assert sorted((d.kind, d.reason.split(",")[0]) for d in letters) == [
        ("invalid", "invalid RewardRecorded: value: Value error"),
        ("unknown_attempt", "a reward for attempt 'not-an-attempt' of rollout 'r1'"),
        ("unknown_rollout", "a reward for rollout 'nobody'"),
        ("unknown_rollout", "a reward for rollout 'r-early'"),
    ]
    await assert_equals_replay(kafka, database)
