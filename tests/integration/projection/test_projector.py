"""The projector turns what runners did into rows the query API reads."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

from agl_stream.bus.kafka import producer
from agl_stream.bus.streams import EventPublisher, Topics
from agl_stream.projection.replay import ReplayLimits, list_read_models, replay
from agl_stream.queries import ReadModel
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings
from tests.integration.projection.test_projector_kill import ends
from tests.support.helpers import eventually, invoke_cli
from tests.support.projection import caught_up, dump, projector_in_process
from tests.support.runs import queue, runner_in_process, wait_terminal
from tests.support.traffic import Traffic, traffic


async def test_runs_become_rows(kafka: KafkaSettings, database: DatabaseSettings) -> None:
    tasks = [{"spans": 3, "reward": 0.5}] * 6 + [{"spans": 1, "fail_on_attempts": [1]}] * 2
    ids = await queue(kafka, tasks, max_attempts=2, retry_condition=("failed",))
    async with (
        projector_in_process(kafka, database),
        runner_in_process(kafka, concurrency=4),
        ReadModel.open(database) as rm,
    ):
        statuses = await rm.wait_for_rollouts(ids, within=60)
        assert set(statuses.values()) == {"succeeded"}
        retried = ids[-1]
        attempts = await rm.attempts(retried)
        assert [a.status for a in attempts] == ["failed", "succeeded"]
        assert all(a.complete for a in attempts)
        rollout = await rm.rollout(retried)
        assert rollout.attempt_count == 2 and rollout.latest_attempt_id == attempts[1].attempt_id
        spans = await rm.spans(ids[0], latest_attempt=True)
        assert [s.sequence for s in spans] == list(range(len(spans)))
        assert len(spans) == attempts[0].span_count or len(spans) >= 3
        page = await rm.rollouts(status=("succeeded",), limit=5)
        assert len(page.items) == 5 and page.next_cursor is not None
        rest = await rm.rollouts(status=("succeeded",), limit=5, cursor=page.next_cursor)
        assert {r.rollout_id for r in page.items + rest.items} == set(ids)
        workers = await rm.workers()
        assert {w.role for w in workers} >= {"runner", "projector"}
    h = await wait_terminal(kafka, ids, 5)
    assert all(h.final(i) is not None for i in ids)


async def publish(kafka: KafkaSettings, sent: Traffic) -> None:
    async with producer(kafka, linger_ms=5) as prod:
        publisher = EventPublisher(prod, Topics(kafka))
        await asyncio.gather(*[await publisher.send(t, e) for t, e in sent])


async def test_replay_switches_while_queries_go_on(
    kafka: KafkaSettings, database: DatabaseSettings
) -> None:
    first = traffic(seed=31, rollouts=80, prefix="first")
    second = traffic(seed=32, rollouts=20, prefix="second")
    await publish(kafka, first)
    failures: list[BaseException] = []
    answers: list[int] = []
    stop = asyncio.Event()

    async def keep_asking() -> None:
        async with ReadModel.open(database) as rm:
            while not stop.is_set():
                try:
                    page = await rm.rollouts(limit=1000)
                    answers.append(len(page.items))
                except Exception as exc:  # noqa: BLE001 - the test counts any failure
                    failures.append(exc)
                await asyncio.sleep(0.02)

    async with projector_in_process(kafka, database) as projector, ReadModel.open(database) as rm:
        published = await ends(kafka)
        await eventually(
            lambda: caught_up(database, published), 60, "the first traffic to be projected"
        )
        before = await dump(database)
        asking = asyncio.create_task(keep_asking())
        result = await replay(kafka, database)
        assert result.switched and result.name == "read_model_2"
        await publish(kafka, second)
        # The live projector follows the new read model and goes on from its offsets.
        await eventually(lambda: _count(rm, 100, "read_model_2"), 60, "the projector to follow")
        stop.set()
        await asyncio.wait_for(asking, 10)
        assert projector.projection.schema == "read_model_2"
    assert not failures, failures[:3]
    assert answers and min(answers) >= 80
    after = await dump(database)
    for rollout_id, value in before.items():
        if rollout_id.startswith("first"):
            assert after[rollout_id] == value
    models = {m["name"]: m for m in await list_read_models(database)}
    assert models["read_model_2"]["active"] and models["read_model_1"]["state"] == "retired"


async def _count(rm: ReadModel, n: int, read_model: str | None = None) -> bool:
    async with ReadModel.open(rm.database, read_model) as other:
        return len((await other.rollouts(limit=1000)).items) >= n


async def test_replay_until_a_time_shows_the_past(
    kafka: KafkaSettings, database: DatabaseSettings
) -> None:
    await publish(kafka, traffic(seed=41, rollouts=30, prefix="early"))
    await asyncio.sleep(1.0)
    between = datetime.now(UTC)
    await asyncio.sleep(1.0)
    await publish(kafka, traffic(seed=42, rollouts=30, prefix="late"))
    result = await replay(kafka, database, name="as_of", limits=ReplayLimits(until_time=between))
    assert not result.switched
    past = await dump(database, "as_of")
    ids = {k for k in past if k not in ("resources", "workers")}
    assert len(ids) == 30 and all(k.startswith("early") for k in ids)
    url = ("--database-url", database.database_url.get_secret_value())
    shown = await invoke_cli(*url, "query", "rollouts", "--read-model", "as_of", "--json")
    assert shown.exit_code == 0 and len(json.loads(shown.output)["items"]) == 30


async def test_replay_cli_rejects_bad_input(
    kafka: KafkaSettings, database: DatabaseSettings
) -> None:
    args = (
        "--database-url", database.database_url.get_secret_value(),
        "--bootstrap-servers", kafka.bootstrap_servers, "--topic-prefix", kafka.topic_prefix,
        "replay",
    )  # fmt: skip
    for extra, expected in [
        (("--name", "Bad Name"), "cannot name a read model"),
        (("--until-offset", "spans:3"), "write TOPIC:PARTITION=OFFSET"),
        (("--until-offset", "nosuch:0=5"), "no topic 'nosuch'"),
        (("--until-offset", "spans:99=5"), "has partitions 0-7, not 99"),
        (("--until-time", "soon"), "is not a time"),
        (("--name", "read_model_1"), "exists already"),
    ]:
        result = await invoke_cli(*args, *extra)
        assert result.exit_code != 0, extra
        assert expected in result.output, (extra, result.output)
        assert "Traceback" not in result.output
