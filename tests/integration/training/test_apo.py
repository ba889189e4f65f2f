"""APO through the real broker and PostgreSQL: a runner runs the agent on candidate templates
(pinned), a projector keeps the read model APO measures from, and an OpenAI-compatible
endpoint critiques and rewrites (tests/support/apo_world.py: which rewrite is better is only known
by measuring it). Killed with SIGKILL, a restarted APO neither loses nor repeats a rollout."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiokafka import TopicPartition

from agl_stream.bus.streams import EventPublisher, Topics, read_partitions
from agl_stream.commands.resources import ResourceCache
from agl_stream.embedded.process import free_port
from agl_stream.events import LLM, ResourcesPublished, RolloutQueued
from agl_stream.queries import ReadModel
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings, child_environment
from agl_stream.serving.engine import Loaded
from agl_stream.serving.server import PolicyServer
from agl_stream.training.apo.optimizer import Apo, ApoConfig, ApoError, RoundReport, read_state
from agl_stream.training.model import tiny_chat_policy
from tests.support import apo_world
from tests.support.helpers import eventually, invoke_cli
from tests.support.projection import projector_in_process
from tests.support.runs import publish_resources, runner_in_process

AGENT = "tests.support.apo_world:follow_rules"
# The runner shares this process's event loop with APO, the projector and the endpoint. On a
# loaded CI machine all ten rollouts of one candidate once ran without its version (most
# likely the runner saw the pinned version after the default 10 s wait and failed them as
# UnknownResources). These tests are about APO's choices, not that wait.
PIN_WAIT = 60.0


@asynccontextmanager
async def world_endpoint() -> AsyncIterator[tuple[str, web.Application]]:
    app = apo_world.app()
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/v1", app
    finally:
        await runner.cleanup()


async def publish_llm(kafka: KafkaSettings, endpoint: str) -> None:
    await publish_resources(kafka, "setup-v0", llm=LLM(endpoint=endpoint, model="rules"))


async def resources(kafka: KafkaSettings) -> list[ResourcesPublished]:
    events = await read_partitions(kafka, [TopicPartition(kafka.topic("resources"), 0)])
    return [e for e in events if isinstance(e, ResourcesPublished)]


async def queued(kafka: KafkaSettings) -> list[RolloutQueued]:
    topics = Topics(kafka)
    tps = [TopicPartition(topics.name("tasks"), p) for p in range(topics.specs["tasks"].partitions)]
    return [e for e in await read_partitions(kafka, tps) if isinstance(e, RolloutQueued)]


def config(state_dir: Path, endpoint: str, **overrides: object) -> ApoConfig:
    settings: dict[str, object] = {
        "state_dir": str(state_dir), "train_tasks": apo_world.tasks(12, seed=1),
        "val_tasks": apo_world.tasks(10, seed=2), "optimizer_endpoint": endpoint,
        "optimizer_model": "rules", "seed_template": apo_world.SEED_TEMPLATE, "rounds": 2,
        "beam_width": 2, "branch": 3, "train_batch": 6, "wait_seconds": 120.0,
    }  # fmt: skip
    return ApoConfig(**{**settings, **overrides})  # type: ignore[arg-type]


async def test_apo_keeps_the_best_template_by_measured_reward(
    kafka: KafkaSettings, database: DatabaseSettings, tmp_path: Path
) -> None:
    async with world_endpoint() as (endpoint, app):
        await publish_llm(kafka, endpoint)
        reports: list[RoundReport] = []
        progress: list[tuple[str, int, int]] = []
        apo = Apo(
            kafka, database, config(tmp_path / "apo", endpoint), on_round=reports.append,
            on_progress=lambda *seen: progress.append(seen),
        )  # fmt: skip
        async with (
            projector_in_process(kafka, database),
            runner_in_process(kafka, AGENT, concurrency=16, pin_wait_seconds=PIN_WAIT),
        ):
            state = await asyncio.wait_for(apo.run(asyncio.Event()), 240)

    assert [r.round for r in reports] == [0, 1, 2]
    assert ("round 0: c0 on 10 val tasks", 10, 10) in progress
    assert ("round 1: c0 on 6 train tasks", 6, 6) in progress
    seed = state.candidates["c0"]
    assert seed.score == 0.0  # the seed template asks for nothing the tasks want
    # Round 1: rewrite 1 adds the least wanted rule, rewrite 2 the most wanted, rewrite 3
    # drops the placeholder. Only measuring tells the first two apart.
    first = {c.cid: c for c in reports[1].candidates}
    assert sorted(first) == ["c1", "c2", "c3"]
    assert first["c3"].rejected == "placeholders changed: dropped {question}"
    assert 0 < first["c1"].score < first["c2"].score  # type: ignore[operator]
    assert reports[1].best.cid == "c2"
    # Each round's best is the best measured so far; it rose every round.
    scores = [r.best.score for r in reports]
    assert scores[0] < scores[1] < scores[2]  # type: ignore[operator]
    measured = [c for c in state.candidates.values() if c.score is not None]
    assert state.best().score == max(c.score for c in measured)  # type: ignore[union-attr,type-var]
    assert all(len(c.rewards or []) == 10 for c in measured)
    assert all(c.score is None for c in state.candidates.values() if c.rejected)

    # Candidates were pin-only: the latest version runners hand out is always a published
    # best, which carries the LLM resource along with the template.
    events = await resources(kafka)
    cache = ResourceCache()
    for event in events:
        cache.apply(event)
    best = state.best()
    assert best is not None
    assert cache.latest is not None
    assert cache.latest.resources_id == state.published[-1].resources_id
    assert cache.latest.resources["prompt"].template == best.template  # type: ignore[union-attr]
    assert isinstance(cache.latest.resources["llm"], LLM)
    assert [e.metadata["candidate"] for e in events if not e.pin_only and e.metadata] == [
        p.cid for p in state.published
    ]
    async with ReadModel.open(database) as model:
        assert (await model.latest_resources()).resources_id == state.published[-1].resources_id
        # Every candidate rollout ran with its candidate's version, in the mode it was asked.
        for candidate in measured:
            page = await model.rollouts(metadata={"apo_batch": f"{candidate.cid}-val"}, limit=100)
            assert {r.attempt_resources_id for r in page.items} == {candidate.resources_id}
            assert {r.mode for r in page.items} == {"val"}
    # The critic saw the attempts' conversations: one critique per parent and round.
    assert Counter(app[apo_world.CALLS])["You review t"] == 1 + 2
    assert len(state.critiques) == 3


async def test_an_optimizer_that_cannot_take_the_request_stops_apo_with_its_reason(
    kafka: KafkaSettings, database: DatabaseSettings, tmp_path: Path
) -> None:
    """The project's own policy server (a tiny chat model, 256 tokens of context) as the
    optimizer: the critique request does not fit, and APO says so instead of going on."""
    server = PolicyServer()
    server.load(Loaded(tiny_chat_policy(seed=3), "chat-v1"))
    optimizer = f"{await server.start('127.0.0.1', 0)}/v1"
    try:
        async with world_endpoint() as (endpoint, _):
            await publish_llm(kafka, endpoint)
            apo = Apo(kafka, database, config(tmp_path / "apo", optimizer, max_tokens=64))
            async with (
                projector_in_process(kafka, database),
                runner_in_process(kafka, AGENT, concurrency=16, pin_wait_seconds=PIN_WAIT),
            ):
                with pytest.raises(ApoError, match=r"failed: .*exceed the model's context of 256"):
                    await asyncio.wait_for(apo.run(asyncio.Event()), 120)
    finally:
        await server.stop()
    state = read_state(str(tmp_path / "apo"))
    assert state is not None
    assert state.round == 1  # the seed was measured; nothing after it was made up
    assert state.critiques == {}
    assert list(state.candidates) == ["c0"]


class Crash(Exception):
    """Stands for the process dying at that instant."""


async def test_a_batch_cut_off_while_queuing_is_completed_without_duplicates(
    kafka: KafkaSettings,
    database: DatabaseSettings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    publish_many = EventPublisher.publish_many

    async def half_then_die(self: EventPublisher, topic: str, events: list[Any]) -> list[Any]:
        if topic == "tasks":
            await publish_many(self, topic, events[: len(events) // 2])
            raise Crash
        return await publish_many(self, topic, events)

    async with world_endpoint() as (endpoint, _):
        await publish_llm(kafka, endpoint)
        async with (
            projector_in_process(kafka, database),
            runner_in_process(kafka, AGENT, concurrency=16, pin_wait_seconds=PIN_WAIT),
        ):
            settings = config(tmp_path / "apo", endpoint, rounds=0)
            with monkeypatch.context() as patch:
                patch.setattr(EventPublisher, "publish_many", half_then_die)
                with pytest.raises(Crash):
                    await Apo(kafka, database, settings).run(asyncio.Event())
            cut = read_state(str(tmp_path / "apo"))
            assert cut is not None
            assert cut.batches == {"c0-val": "queuing"}
            assert len(await queued(kafka)) == 5
            other = config(tmp_path / "apo", endpoint, rounds=0, val_tasks=apo_world.tasks(10, 3))
            with pytest.raises(ApoError, match="started with other training or validation"):
                await Apo(kafka, database, other).run(asyncio.Event())
            state = await asyncio.wait_for(Apo(kafka, database, settings).run(asyncio.Event()), 120)

    assert state.batches == {"c0-val": "queued"}
    counts = Counter(e.rollout_id for e in await queued(kafka))
    assert sorted(counts) == [f"{state.run_id}-c0-val-{i}" for i in range(10)]
    assert set(counts.values()) == {1}
    assert len(state.candidates["c0"].rewards or []) == 10


async def apo_process(
    kafka: KafkaSettings, database: DatabaseSettings, state_dir: Path, endpoint: str, log: Path
) -> asyncio.subprocess.Process:
    data = state_dir.parent
    (data / "train.jsonl").write_text(
        "".join(json.dumps(t) + "\n" for t in apo_world.tasks(12, seed=1))
    )
    (data / "val.jsonl").write_text(
        "".join(json.dumps(t) + "\n" for t in apo_world.tasks(10, seed=2))
    )
    with log.open("ab") as out:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agl_stream.cli.main", "worker", "trainer",
            "--algorithm", "apo", "--checkpoint-dir", str(state_dir),
            "--train-tasks", str(data / "train.jsonl"), "--val-tasks", str(data / "val.jsonl"),
            "--optimizer-endpoint", endpoint, "--optimizer-model", "rules",
            "--prompt", apo_world.SEED_TEMPLATE, "--rounds", "2", "--branch", "3",
            "--train-batch", "6", env=child_environment(kafka, database), stdout=out, stderr=out,
        )  # fmt: skip


async def test_apo_killed_mid_round_resumes_without_losing_or_repeating(
    kafka: KafkaSettings, database: DatabaseSettings, tmp_path: Path
) -> None:
    state_dir = tmp_path / "apo"
    log = tmp_path / "apo.log"
    async with (
        world_endpoint() as (endpoint, _),
        projector_in_process(kafka, database),
        runner_in_process(kafka, AGENT, concurrency=16, pin_wait_seconds=PIN_WAIT),
    ):
        # As a user would: the endpoint agents call, published from the command line.
        published = await invoke_cli(
            "--bootstrap-servers", kafka.bootstrap_servers, "--topic-prefix", kafka.topic_prefix,
            "resources", "publish", "setup-v0", "--llm", f"llm={endpoint}@rules",
        )  # fmt: skip
        assert published.exit_code == 0, published.output
        assert "as version 0" in published.output
        again = await invoke_cli(
            "--bootstrap-servers", kafka.bootstrap_servers, "--topic-prefix", kafka.topic_prefix,
            "resources", "publish", "setup-v0", "--llm", f"llm={endpoint}@rules",
        )  # fmt: skip
        assert again.exit_code == 0, again.output  # safe to run again: found, not doubled
        assert "already published with these resources, as version 0" in again.output
        other = await invoke_cli(
            "--bootstrap-servers", kafka.bootstrap_servers, "--topic-prefix", kafka.topic_prefix,
            "resources", "publish", "setup-v0", "--llm", "llm=http://elsewhere/v1@rules",
        )  # fmt: skip
        assert other.exit_code == 2
        assert "already published with other resources" in other.output
        first = await apo_process(kafka, database, state_dir, endpoint, log)

        async def mid_round_one() -> bool:
            return len(await queued(kafka)) >= 20 or first.returncode is not None

        await eventually(mid_round_one, 120, "APO to queue round 1's rollouts")
        assert first.returncode is None, log.read_text()[-3000:]
        first.send_signal(signal.SIGKILL)
        await first.wait()
        killed_at = read_state(str(state_dir))
        assert killed_at is not None
        assert killed_at.round < 3, "APO finished before it could be killed"
        second = await apo_process(kafka, database, state_dir, endpoint, log)
        assert await asyncio.wait_for(second.wait(), 240) == 0, log.read_text()[-3000:]

    state = read_state(str(state_dir))
    assert state is not None
    assert state.round == 3
    assert state.run_id == killed_at.run_id
    assert [h["round"] for h in state.history] == [0, 1, 2]
    # Every rollout of every batch is on the tasks topic exactly once.
    counts = Counter(e.rollout_id for e in await queued(kafka) if e.attempt_number == 1)
    assert counts, "no rollouts queued"
    assert max(counts.values()) == 1, [k for k, v in counts.items() if v > 1]
    expected = sum(6 for key in state.critiques) + 10 * sum(
        1 for c in state.candidates.values() if c.rejected is None
    )
    assert sum(counts.values()) == expected
    assert all(status == "queued" for status in state.batches.values())
    # Versions: each candidate id and each published best always with the same content.
    contents: dict[str, set[str]] = {}
    for event in await resources(kafka):
        contents.setdefault(event.resources_id, set()).add(event.model_dump_json(
            include={"version", "resources", "parent_resources_id"}
        ))  # fmt: skip
    assert all(len(v) == 1 for v in contents.values())
    assert {p.resources_id for p in state.published} <= set(contents)
    best = state.best()
    assert best is not None
    assert best.score is not None
    assert best.score > state.candidates["c0"].score  # type: ignore[operator]
    assert "best template" in log.read_text()
