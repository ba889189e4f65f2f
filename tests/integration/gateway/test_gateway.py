"""The gateway and the policy server through the real broker: agents written with the plain
`openai` client (tests/support/openai_agents.py, no agl-stream import) run by a runner; every
call is recorded in its attempt with token ids that decode to exactly what was sent and answered."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from agl_stream.agent.llm import (
    COMPLETION,
    POLICY,
    PROMPT_JSON,
    PROMPT_TOKEN_IDS,
    RESOURCES_ID,
    RESPONSE_LOGPROBS,
    RESPONSE_TOKEN_IDS,
)
from agl_stream.bus.kafka import producer
from agl_stream.bus.streams import EventPublisher, Topics
from agl_stream.embedded.process import free_port
from agl_stream.events import LLM, AttemptStatus, Checkpoint, SpanRecorded, StatusCode
from agl_stream.gateway.proxy import Gateway
from agl_stream.gateway.recording import UNATTRIBUTED
from agl_stream.queries import NotFound, ReadModel
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings, child_environment
from agl_stream.serving.engine import Loaded, TorchEngine
from agl_stream.serving.server import PolicyServer
from agl_stream.training.model import content_hash, save_policy, tiny_chat_policy
from benchmarks import stub_upstream
from tests.support.helpers import eventually
from tests.support.projection import projector_in_process
from tests.support.runs import publish_resources, queue, runner_in_process, wait_terminal
from tests.support.scrape import scrape, unlabelled

CALL = "agl.llm.call"


async def publish_llm(kafka: KafkaSettings, endpoint: str) -> None:
    await publish_resources(kafka, "llm-1", llm=LLM(endpoint=endpoint, model="policy"))


def check_sequence(spans: list[SpanRecorded], span_count: int) -> None:
    """Every span of the attempt once, numbered 0..span_count-1."""
    assert sorted(s.sequence for s in spans) == list(range(span_count))


def check_decodes(tokenizer: object, call: SpanRecorded) -> None:
    """The recorded ids decode to the exact prompt the server saw and the exact answer."""
    a = call.attributes
    prompt = json.loads(str(a[PROMPT_JSON]))
    if "messages" in prompt:
        sent = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            prompt["messages"], tokenize=False, add_generation_prompt=True
        )
    else:
        sent = prompt["text"]
    assert tokenizer.decode(a[PROMPT_TOKEN_IDS], skip_special_tokens=False) == sent  # type: ignore[attr-defined]
    answer = tokenizer.decode(a[RESPONSE_TOKEN_IDS], skip_special_tokens=True)  # type: ignore[attr-defined]
    assert answer == a[COMPLETION]
    assert len(a[RESPONSE_LOGPROBS]) == len(a[RESPONSE_TOKEN_IDS])  # type: ignore[arg-type]


async def test_plain_openai_agent_is_recorded_with_exact_token_ids(kafka: KafkaSettings) -> None:
    policy = tiny_chat_policy(seed=3)
    server = PolicyServer()
    server.load(Loaded(policy, "chat-v1"))
    url = await server.start("127.0.0.1", 0)
    await publish_llm(kafka, f"{url}/v1")
    task = {
        "system": "Answer in one word.",
        "questions": ["Héllo, wörld?", "What is 2 + 2?", "And 😀 — why?", "Bye."],
    }
    ids = await queue(kafka, [task] * 3)
    try:
        async with runner_in_process(
            kafka, "tests.support.openai_agents:chat", concurrency=3
        ) as runner:
            h = await wait_terminal(kafka, ids, 90)
            assert runner.gateway is not None
            gateway = await scraped(runner.gateway.url)
            policy_server = await scraped(url)
    finally:
        await server.stop()
    # The gateway's and the policy server's /metrics count the 15 calls and their tokens.
    assert gateway["agl_stream_gateway_calls_total"] == 15
    assert gateway["agl_stream_gateway_call_seconds_count"] == 15
    assert gateway["agl_stream_gateway_failed_total"] == 0
    assert policy_server["agl_stream_policy_server_requests_total"] == 15
    assert (
        gateway["agl_stream_gateway_response_tokens_total"]
        == policy_server["agl_stream_policy_server_generated_tokens_total"]
        > 0
    )
    for rollout_id in ids:
        (finished,) = h.finished[rollout_id]
        assert finished.status is AttemptStatus.SUCCEEDED, finished.error
        spans = h.spans[finished.attempt_id]
        check_sequence(spans, finished.span_count)
        attempt_span = next(s for s in spans if s.name == "agl.attempt")
        calls = sorted((s for s in spans if s.name == CALL), key=lambda s: s.end_time_unix_nano)
        assert len(calls) == 5  # four chat turns and one completion
        for call in calls:
            check_decodes(policy.tokenizer, call)
            assert call.status.code is not StatusCode.ERROR
            assert call.attributes[RESOURCES_ID] == "chat-v1"
            # In the attempt's trace, under its span: a trace reads as the agent ran.
            assert (call.trace_id, call.parent_span_id) == (
                attempt_span.trace_id, attempt_span.span_id,
            )  # fmt: skip
        # Multi-turn: each turn resends the conversation, with the answers as the agent got
        # them (streamed ones assembled from deltas) - the same text the ids decode to.
        for earlier, later in itertools.pairwise(calls[:4]):
            conversation = json.loads(str(later.attributes[PROMPT_JSON]))["messages"]
            assert conversation[-2] == {
                "role": "assistant", "content": earlier.attributes[COMPLETION],
            }  # fmt: skip
        streamed = [c for c in calls if c.attributes.get("agl.gateway.stream_chunks")]
        assert len(streamed) == 2
        assert json.loads(str(calls[-1].attributes[PROMPT_JSON])) == {"text": task["system"]}


async def scraped(base_url: str) -> dict[str, float]:
    return unlabelled(await scrape(f"{base_url}/metrics"))


@asynccontextmanager
async def served(kafka: KafkaSettings, port: int) -> AsyncIterator[asyncio.subprocess.Process]:
    """`agl-stream serve --model tiny-chat` as a process, once it answers."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agl_stream.cli.main", "serve", "--model", "tiny-chat",
        "--port", str(port), "--seed", "5",
        env=child_environment(kafka), stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip

    async def up() -> bool:
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://127.0.0.1:{port}/health") as response,
            ):
                return response.status == 200
        except aiohttp.ClientError:
            return False

    try:
        await eventually(up, 60, "the policy server to answer")
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_killing_the_policy_server_mid_request(kafka: KafkaSettings) -> None:
    port = free_port()
    await publish_llm(kafka, f"http://127.0.0.1:{port}/v1")
    ids = await queue(kafka, [{"calls": 12, "parallel": 3, "max_tokens": 200}], timeout_seconds=240)
    async with runner_in_process(kafka, "tests.support.openai_agents:persistent") as runner:
        async with served(kafka, port) as server:

            async def busy() -> bool:
                gateway = runner.gateway
                assert gateway is not None
                in_flight = any(route.calls for route in gateway.routes.values())
                return gateway.counts["calls"] >= 2 and in_flight

            await eventually(busy, 60, "calls in flight through the gateway")
            server.kill()  # kill -9, mid-request
            await server.wait()
        await asyncio.sleep(1.0)  # calls in between find nothing listening
        async with served(kafka, port):
            h = await wait_terminal(kafka, ids, 120)
    (finished,) = h.finished[ids[0]]
    assert finished.status is AttemptStatus.SUCCEEDED, finished.error
    spans = h.spans[finished.attempt_id]
    check_sequence(spans, finished.span_count)
    calls = [s for s in spans if s.name == CALL]
    failed = [c for c in calls if c.status.code is StatusCode.ERROR]
    completed = [c for c in calls if c.status.code is not StatusCode.ERROR]
    # The agent's reward is 1000 x the calls it completed + the errors it was given.
    assert finished.reward is not None
    done, errors = divmod(int(finished.reward), 1000)
    assert done >= 12 and errors >= 1
    assert (len(completed), len(failed)) == (done, errors)
    assert any("upstream failed" in (c.status.description or "") for c in failed)
    policy = tiny_chat_policy(seed=5)
    for call in completed:
        check_decodes(policy.tokenizer, call)


async def test_a_restarted_gateway_keeps_the_calls_of_both_runs(
    kafka: KafkaSettings, database: DatabaseSettings
) -> None:
    """Two standalone gateways one after the other in this process, so with the same host and
    pid, as a restarted container's: each numbers its calls with no attempt from 0, and the
    read model used to drop the second one's as duplicates of the first's."""
    upstream = web.AppRunner(stub_upstream.app(tokens=3))
    await upstream.setup()
    site = web.TCPSite(upstream, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{upstream.addresses[0][1]}/v1"
    try:
        async with producer(kafka) as prod:
            for run in range(2):
                gateway = Gateway(base, EventPublisher(prod, Topics(kafka)))
                url = await gateway.start()
                request = {"model": "stub", "messages": [{"role": "user", "content": f"{run}"}]}
                async with (
                    aiohttp.ClientSession() as session,
                    session.post(f"{url}/v1/chat/completions", json=request) as response,
                ):
                    assert response.status == 200
                await gateway.stop()  # sends what it recorded
    finally:
        await upstream.cleanup()
    async with projector_in_process(kafka, database), ReadModel.open(database) as rm:

        async def both() -> bool:
            with contextlib.suppress(NotFound):
                return len(await rm.spans(UNATTRIBUTED)) == 2
            return False

        await eventually(both, 60, "both gateways' calls in the read model")
        first, second = await rm.spans(UNATTRIBUTED)
    assert first.attempt_id != second.attempt_id
    assert first.sequence == second.sequence == 0


async def test_an_error_event_mid_stream_records_the_call_as_failed(kafka: KafkaSettings) -> None:
    """An upstream that fails after its first tokens says so in an error event (the policy
    server does when its engine dies): the call is recorded as failed, with the message."""

    async def failing(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [7]}]}
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        error = {"error": {"message": "the engine stopped", "type": "engine_unavailable"}}
        await response.write(b"data: " + json.dumps(error).encode() + b"\n\n")
        await response.write_eof()
        return response

    application = web.Application()
    application.router.add_post("/v1/chat/completions", failing)
    upstream = web.AppRunner(application)
    await upstream.setup()
    await web.TCPSite(upstream, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{upstream.addresses[0][1]}/v1"
    try:
        async with producer(kafka) as prod:
            gateway = Gateway(base, EventPublisher(prod, Topics(kafka)))
            url = await gateway.start()
            request = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "a"}]}
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"{url}/v1/chat/completions", json=request) as response,
            ):
                assert b"the engine stopped" in await response.read()
            await gateway.stop()
    finally:
        await upstream.cleanup()
    assert gateway.counts["failed"] == 1 and gateway.counts["calls"] == 1


@pytest.mark.parametrize("one_server", [False, True], ids=["a server each", "one server"])
async def test_a_call_naming_a_policy_goes_to_its_server_and_its_span_names_it(
    kafka: KafkaSettings, tmp_path: Path, one_server: bool
) -> None:
    """Several policies: the attempt's version holds a checkpoint per policy and an LLM serving
    each (its model the policy's name). A call through either LLM resource that names a
    policy as its model is answered by that policy's server, or by that policy in one server
    of both (`serve --policy speaker --policy listener`); every call's span names the policy
    that answered (what each policy's trainer takes)."""
    servers, resources = [], {}
    both = PolicyServer(policies=("speaker", "listener"))
    url = await both.start("127.0.0.1", 0) if one_server else ""
    try:
        for seed, name in enumerate(("speaker", "listener"), start=1):
            policy = tiny_chat_policy(seed=seed)
            directory = tmp_path / name
            save_policy(policy, directory)
            made = Checkpoint(uri=directory.as_uri(), content_hash=content_hash(directory))
            resources[name] = made
            if one_server:
                lane = both.lanes[name].engine
                assert isinstance(lane, TorchEngine)
                lane.put(Loaded(policy, f"{name}-v1"))
            else:
                server = PolicyServer(model_name=name)
                server.load(Loaded(policy, f"{name}-v1"))
                url = await server.start("127.0.0.1", 0)
                servers.append(server)
            resources[f"{name}_llm"] = LLM(endpoint=f"{url}/v1", model=name)
        # The agent is handed `llm`: the speaker's LLM resource under the usual name.
        resources["llm"] = resources.pop("speaker_llm")
        await publish_resources(kafka, "two-v1", **resources)
        ids = await queue(kafka, [{"say": "a"}, {"say": "b"}])
        async with runner_in_process(kafka, "tests.support.openai_agents:speaker_then_listener"):
            h = await wait_terminal(kafka, ids, 90)
    finally:
        for server in [*servers, both]:
            await server.stop()
    for rollout_id in ids:
        (finished,) = h.finished[rollout_id]
        assert finished.status is AttemptStatus.SUCCEEDED, finished.error
        calls = sorted(
            (s for s in h.spans[finished.attempt_id] if s.name == CALL),
            key=lambda s: s.end_time_unix_nano,
        )
        answered = [(c.attributes.get(POLICY), c.attributes[RESOURCES_ID]) for c in calls]
        assert answered == [
            ("speaker", "speaker-v1"), ("listener", "listener-v1"), ("speaker", "speaker-v1"),
        ]  # fmt: skip
