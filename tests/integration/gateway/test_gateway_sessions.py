"""Gateway sessions through the real broker and database: an application's conversations
(a session key per conversation) become rollouts with their calls as spans, joined with the
feedback it posts to /rewards; the trainer's assembler makes trajectories of them that
take their reward from the feedback, and the read model shows them."""

from __future__ import annotations

import asyncio
import importlib.util
import signal
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import ModuleType

import aiohttp
import openai
from aiokafka import TopicPartition

from agl_stream.bus.kafka import producer
from agl_stream.bus.streams import EventPublisher, Topics, read_partitions
from agl_stream.embedded.process import free_port
from agl_stream.events import (
    AttemptFinished,
    AttemptStatus,
    RolloutFinished,
    RolloutStatus,
    SpanRecorded,
)
from agl_stream.gateway.proxy import Gateway
from agl_stream.gateway.sessions import SessionConfig
from agl_stream.queries import ReadModel
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings
from agl_stream.serving.engine import Loaded
from agl_stream.serving.server import PolicyServer
from agl_stream.training.model import tiny_policy
from agl_stream.training.trajectories import Assembler, LateRewardRule
from tests.support import ROOT
from tests.support.helpers import cli_process, eventually
from tests.support.projection import caught_up, ends, projector_in_process

TOKEN = "sessions-test-token"
APP = ROOT / "examples" / "online_gateway" / "app.py"


def _app() -> ModuleType:
    spec = importlib.util.spec_from_file_location("online_app", APP)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@asynccontextmanager
async def gateway_with_sessions(kafka: KafkaSettings) -> AsyncIterator[Gateway]:
    server = PolicyServer()
    server.load(Loaded(tiny_policy(1), "policy-v1"))
    upstream = await server.start("127.0.0.1", 0)
    try:
        async with producer(kafka) as prod:
            gateway = Gateway(
                f"{upstream}/v1", EventPublisher(prod, Topics(kafka)),
                sessions=SessionConfig(idle_seconds=1.0), reward_token=TOKEN,
            )  # fmt: skip
            await gateway.start()
            try:
                yield gateway
            finally:
                await gateway.stop()
    finally:
        await server.stop()


async def test_sessions_become_rollouts_joined_with_their_feedback(
    kafka: KafkaSettings, database: DatabaseSettings
) -> None:
    async with gateway_with_sessions(kafka) as gateway:
        url = gateway.url
        feedback = await _app().run(url, TOKEN, users=4, conversations=12)
        llm = openai.AsyncOpenAI(api_key="unused", base_url=f"{url}/v1", max_retries=0)
        talk = {"X-AGL-Session": "long"}
        await llm.models.list(extra_headers=talk)  # not a recorded call: starts nothing
        assert gateway.sessions is not None and "long" not in gateway.sessions.open
        first = await llm.completions.with_raw_response.create(
            model="p", prompt="<bos> a", max_tokens=2, extra_headers=talk
        )
        rollout_id = first.headers["X-AGL-Rollout-Id"]
        call = first.headers["X-AGL-Call-Id"]
        assert rollout_id == "session-long" and len(call) == 16
        stream = await llm.completions.create(
            model="p", prompt="<bos> b", max_tokens=2, stream=True, extra_headers=talk
        )
        assert [c async for c in stream]
        # Ended by idleness (1 s); a call with its key then is refused, saying why.
        sessions = gateway.sessions
        assert sessions is not None

        async def ended() -> bool:
            return "long" in sessions.ended and "long" not in sessions.open

        await eventually(ended, 30, "the idle session to end")
        async with aiohttp.ClientSession() as http:
            body = {"model": "p", "prompt": "<bos> c", "max_tokens": 1}
            async with http.post(f"{url}/v1/completions", json=body, headers=talk) as again:
                assert again.status == 409
                assert "has ended" in (await again.json())["error"]["message"]
            async with http.post(
                f"{url}/v1/completions", json=body, headers={"X-AGL-Session": "k" * 201}
            ) as refused:
                assert refused.status == 400
            auth = {"Authorization": f"Bearer {TOKEN}"}
            reward = {"session": "long", "value": 0.5, "name": "feedback", "span_id": call}
            async with http.post(f"{url}/rewards", json=reward, headers=auth) as answer:
                assert answer.status == 200
        await llm.close()

    assert len(feedback) == 12
    topics = Topics(kafka)
    partitions = [
        (t, p) for t in ("tasks", "rollouts", "spans") for p in range(topics.specs[t].partitions)
    ]
    assembler = Assembler(late_reward=LateRewardRule("feedback", wait_seconds=600))
    from aiokafka import TopicPartition

    for topic, partition in partitions:
        tp = TopicPartition(topics.name(topic), partition)
        for offset, event in enumerate(await read_partitions(kafka, [tp])):
            assembler.add((topic, partition), offset, event)
    trajectories = {t.rollout_id: t for t in assembler.complete()}
    assert len(trajectories) == 13
    assert sorted(t.reward for k, t in trajectories.items() if k != rollout_id) == sorted(feedback)
    long = trajectories[rollout_id]
    assert len(long.spans) == 2 and long.reward == 0.5 and long.late_reward is not None
    assert long.late_reward.span_id == call and long.resources_id == "policy-v1"
    assert all(t.reward_from == "late" for t in trajectories.values())
    # Sessions that asked the same thing make one GRPO group.
    assert len({t.group for t in trajectories.values()}) <= 5 + 1

    async with projector_in_process(kafka, database):
        wanted = await ends(kafka)
        await eventually(lambda: caught_up(database, wanted), 60, "the projector")
    async with ReadModel.open(database) as rm:
        rollout = await rm.rollout(rollout_id)
        assert (rollout.status, rollout.mode, rollout.metadata) == (
            "succeeded", "train", {"source": "gateway", "session": "long"},
        )  # fmt: skip
        assert rollout.input == {"prompt": "<bos> a"}
        (attempt,) = await rm.attempts(rollout_id)
        assert attempt.complete and attempt.span_count == 2
        (given,) = await rm.rewards(rollout_id)
        assert (given.name, given.value, given.span_id) == ("feedback", 0.5, call)


def gateway_process(
    kafka: KafkaSettings, upstream: str, port: int, *flags: str
) -> AbstractAsyncContextManager[asyncio.subprocess.Process]:
    return cli_process(
        kafka, "gateway", "--upstream", f"{upstream}/v1", "--port", str(port), *flags
    )


async def test_a_session_whose_gateway_was_killed_is_ended_with_the_reason(
    kafka: KafkaSettings,
) -> None:
    """A gateway killed (-9) mid-session never ends it; another gateway of the deployment
    ends it once quiet past --session-lost-after: unresponsive, saying why, with the spans
    that had reached the broker; the new gateway's own sessions are ended by it, once."""
    server = PolicyServer()
    server.load(Loaded(tiny_policy(1), "policy-v1"))
    upstream = await server.start("127.0.0.1", 0)
    port = free_port()
    body = {"model": "p", "prompt": "<bos> a", "max_tokens": 2}
    try:
        async with aiohttp.ClientSession() as http:

            async def call(key: str) -> bool:
                headers = {"X-AGL-Session": key}
                url = f"http://127.0.0.1:{port}/v1/completions"
                try:
                    async with http.post(url, json=body, headers=headers) as answer:
                        assert answer.status == 200, await answer.text()
                        return True
                except aiohttp.ClientConnectionError:  # not listening yet
                    return False

            async with gateway_process(kafka, upstream, port, "--session-idle", "600") as first:
                await eventually(lambda: call("lost"), 60, "the first gateway to answer")
                await call("lost")

                async def spans_sent() -> bool:
                    return len(await session_spans(kafka, "session-lost")) == 2

                await eventually(spans_sent, 30, "the session's spans on the broker")
                first.send_signal(signal.SIGKILL)
                await first.wait()
            flags = ("--session-idle", "1", "--session-lost-after", "3")
            async with gateway_process(kafka, upstream, port, *flags):
                await eventually(lambda: call("alive"), 60, "the second gateway to answer")

                async def lost_ended() -> bool:
                    return bool(await finished(kafka, "session-lost"))

                await eventually(lost_ended, 60, "the lost session to end")
                await asyncio.sleep(5)  # past --session-lost-after: "alive" is its gateway's
                ((alive, _),) = await finished(kafka, "session-alive")
                assert alive.status is AttemptStatus.SUCCEEDED and alive.error is None
    finally:
        await server.stop()
    ((attempt, rollout),) = await finished(kafka, "session-lost")
    assert attempt.status is AttemptStatus.UNRESPONSIVE and attempt.span_count == 2
    assert attempt.error is not None and attempt.error.type == "SessionLost"
    assert "stopped before ending it" in attempt.error.message
    assert rollout is not None and rollout.status is RolloutStatus.FAILED


async def session_spans(kafka: KafkaSettings, rollout_id: str) -> list[SpanRecorded]:
    events = await read_partitions(kafka, _partitions(kafka, "spans"))
    return [e for e in events if isinstance(e, SpanRecorded) and e.rollout_id == rollout_id]


async def finished(
    kafka: KafkaSettings, rollout_id: str
) -> list[tuple[AttemptFinished, RolloutFinished | None]]:
    events = await read_partitions(kafka, _partitions(kafka, "rollouts"))
    ends = [e for e in events if isinstance(e, RolloutFinished) and e.rollout_id == rollout_id]
    return [
        (e, ends[0] if ends else None)
        for e in events
        if isinstance(e, AttemptFinished) and e.rollout_id == rollout_id
    ]


def _partitions(kafka: KafkaSettings, short: str) -> list[TopicPartition]:
    topics = Topics(kafka)
    return [TopicPartition(topics.name(short), p) for p in range(topics.specs[short].partitions)]
