"""`agl-stream store` speaking Agent Lightning's HTTP store protocol: Agent Lightning's own
LightningStoreClient and an OTLP/HTTP exporter against the CLI server (found through
AGENT_LIGHTNING_STORE_URL), through the real broker and database; Agent Lightning's runner in a
process of its own, whose agent's LLM call arrives as a span; bad requests get a 4xx with the
reason; a server killed with SIGKILL and started again has lost nothing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest

from agl_stream.compat.agl.env import otlp_endpoint
from agl_stream.runtime.config import child_environment
from tests.support.agl_fixtures import Place, fresh_place, rules_llm_endpoint, run_script
from tests.support.backends import Backend

from agentlightning.reward import find_final_reward  # isort: skip
from agentlightning.store.client_server import LightningStoreClient  # isort: skip
from agentlightning.types import LLM, OtelResource, PromptTemplate, Span, TraceStatus  # isort: skip
from tests.support import SUPPORT

RUNNER = SUPPORT / "agl_runner.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def start_server(place: Place, url: str, **extra_env: str) -> asyncio.subprocess.Process:
    """`agl-stream store` with only AGENT_LIGHTNING_STORE_URL saying where: up when healthy."""
    env = child_environment(place.kafka, place.database)
    env.update(AGENT_LIGHTNING_STORE_URL=url, **extra_env)
    for name in ("AGL_SERVER_HOST", "AGL_SERVER_PORT"):
        env.pop(name, None)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agl_stream.cli.main", "store", env=env, start_new_session=True
    )
    async with aiohttp.ClientSession() as http:
        for _ in range(1200):
            if process.returncode is not None:
                raise AssertionError(f"agl-stream store exited with {process.returncode}")
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{url}/v1/agl/health") as response:
                    if response.status == 200:
                        return process
            await asyncio.sleep(0.1)
    raise AssertionError("agl-stream store did not become healthy in 120 s")


async def stop(process: asyncio.subprocess.Process, sig: int = signal.SIGTERM) -> int:
    if process.returncode is None:
        os.killpg(process.pid, sig)
    return await asyncio.wait_for(process.wait(), 60)


@dataclass
class Served:
    place: Place
    url: str
    process: asyncio.subprocess.Process


@pytest.fixture(scope="module")
async def served(embedded_backend: Backend) -> AsyncIterator[Served]:
    """One server for the module (starting one imports Agent Lightning: seconds)."""
    async with fresh_place(embedded_backend) as place:
        url = f"http://127.0.0.1:{free_port()}"
        server = Served(place, url, await start_server(place, url))
        try:
            yield server
        finally:
            await stop(server.process)


def span(rollout_id: str, attempt_id: str, seq: int, trace_id: str = "ab" * 16) -> Span:
    return Span(
        rollout_id=rollout_id, attempt_id=attempt_id, sequence_id=seq, trace_id=trace_id,
        span_id=f"{seq:016x}", parent_id=None, name="reward", status=TraceStatus(status_code="OK"),
        attributes={"agentlightning.reward.0.value": 0.75}, events=[], links=[],
        start_time=1.0, end_time=2.0, context=None, parent=None,
        resource=OtelResource(attributes={}, schema_url=""),
    )  # fmt: skip


async def test_agent_lightnings_client_runs_a_rollout_through_the_server(served: Served) -> None:
    url = served.url
    client = LightningStoreClient(url)
    try:
        resources = await client.add_resources({"llm": LLM(endpoint="http://x/v1", model="m")})
        queued = await client.enqueue_rollout(input={"q": 1}, mode="train")
        assert queued.resources_id == resources.resources_id
        claimed = await client.dequeue_rollout(worker_id="http-runner")
        assert claimed is not None and claimed.rollout_id == queued.rollout_id
        assert claimed.status == "preparing" and claimed.attempt.worker_id == "http-runner"
        rid, aid = claimed.rollout_id, claimed.attempt.attempt_id
        assert await client.get_next_span_sequence_id(rid, aid) == 1
        assert await client.add_span(span(rid, aid, 2)) is not None
        await client.update_attempt(rid, aid, status="succeeded")
        done = await client.wait_for_rollouts(rollout_ids=[rid], timeout=0.1)
        assert [r.status for r in done] == ["succeeded"]
        spans = await client.query_spans(rid, attempt_id="latest")
        assert [s.sequence_id for s in spans] == [2] and spans.total == 1
        assert spans[0].attributes == {"agentlightning.reward.0.value": 0.75}
        page = await client.query_rollouts(status_in=["succeeded"], rollout_id_in=[rid], limit=1)
        assert page.total == 1 and page[0].rollout_id == rid
        worker = await client.get_worker_by_id("http-runner")
        assert worker is not None and worker.status == "idle"
        stats = await client.statistics()
        assert stats["name"] == "AglStreamStore" and stats["total_spans"] >= 1
    finally:
        await client.close()


async def test_otlp_traces_reach_the_attempt(served: Served) -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    url = served.url
    client = LightningStoreClient(url)
    try:
        started = await client.start_rollout(input="otlp")
        rid, aid = started.rollout_id, started.attempt.attempt_id
        endpoint = otlp_endpoint({"AGENT_LIGHTNING_STORE_URL": url})
        assert endpoint == f"{url}/v1/traces"
        provider = TracerProvider(
            resource=Resource.create(
                {"agentlightning.rollout_id": rid, "agentlightning.attempt_id": aid}
            )
        )
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))

        def export() -> None:
            with provider.get_tracer("otlp-test").start_as_current_span(
                "tool", attributes={"n": 3}
            ):
                pass
            provider.shutdown()

        await asyncio.to_thread(export)
        spans = await client.query_spans(rid)
        assert [(s.name, s.attributes.get("n"), s.sequence_id) for s in spans] == [("tool", 3, 1)]
        assert (await client.get_rollout_by_id(rid)).status == "running"  # type: ignore[union-attr]
    finally:
        await client.close()


async def test_a_runner_process_sends_its_agents_llm_call_as_a_span(
    served: Served, tmp_path: Path
) -> None:
    """Agent Lightning's runner in a process of its own (tests/support/agl_runner.py: its Trainer in
    the runner role, LightningStoreClient, the AgentOps tracer) runs an agent that asks an LLM:
    the call arrives as a span of the rollout, with its model, prompt and answer, beside the
    reward. The runner sends it through Agent Lightning's OTLP exporter, which OpenTelemetry's
    HTTP exporter 1.45 broke (agl_stream.compat.agl.otlp_compat mends it)."""
    template = "Cite a source. Answer the question: {question}"
    task = {"question": "question 1", "wants": ["cite"]}
    address = urlsplit(served.url)
    client = LightningStoreClient(served.url)
    try:
        await drain(client)
        resources = await client.add_resources(
            {"prompt_template": PromptTemplate(template=template, engine="f-string")}
        )
        queued = await client.enqueue_rollout(
            input=task, mode="train", resources_id=resources.resources_id
        )
        async with rules_llm_endpoint() as llm:
            env = {
                **os.environ, "AGL_SERVER_HOST": str(address.hostname),
                "AGL_SERVER_PORT": str(address.port), "OPENAI_BASE_URL": llm.url,
                "OPENAI_API_KEY": "unused", "AGENT_MODEL": "rules",
            }  # fmt: skip
            code, output = await run_script(str(RUNNER), "1", env=env, cwd=tmp_path, seconds=120)
        assert code == 0, output[-4000:]
        (attempt,) = await client.query_attempts(queued.rollout_id)
        assert attempt.status == "succeeded", output[-4000:]
        spans = await client.query_spans(queued.rollout_id)
        names = [s.name for s in spans]
        assert "openai.chat.completion" in names, names  # only the reward, without the shim
        (call,) = [s for s in spans if s.name == "openai.chat.completion"]
        assert call.attempt_id == attempt.attempt_id
        assert call.attributes["gen_ai.request.model"] == "rules"
        assert call.attributes["gen_ai.prompt.0.content"] == template.format(**task)
        assert "[cite]" in str(call.attributes["gen_ai.completion.0.content"])
        assert find_final_reward(list(spans)) == 1.0
    finally:
        await client.close()


async def test_bad_requests_get_a_4xx_with_the_reason(served: Served) -> None:
    api = f"{served.url}/v1/agl"
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{api}/rollouts/ro-missing", json={"status": "failed"}) as r:
            assert r.status == 400 and "does not exist" in (await r.json())["detail"]
        async with http.get(f"{api}/rollouts", params={"sort_by": "nope"}) as r:
            assert r.status == 400 and "nope" in (await r.json())["detail"]
        async with http.post(f"{api}/rollouts/search", json={"sort_by": "config"}) as r:
            assert r.status == 400 and "cannot sort by 'config'" in (await r.json())["detail"]
        async with http.post(f"{api}/rollouts", data=b"{not json") as r:
            assert r.status == 422
        started = await (await http.post(f"{api}/rollouts", json={"input": 1})).json()
        bad = span(started["rollout_id"], started["attempt"]["attempt_id"], 1, "not-hex")
        async with http.post(f"{api}/spans", json=bad.model_dump(mode="json")) as r:
            assert r.status == 400 and "trace_id" in (await r.json())["detail"]


async def test_a_killed_server_loses_nothing(served: Served) -> None:
    client = LightningStoreClient(served.url, retry_delays=(), health_retry_delays=())
    try:
        await drain(client)
        queued = [await client.enqueue_rollout(input=i) for i in range(3)]
        ids = [r.rollout_id for r in queued]
        claimed = await client.dequeue_rollout(worker_id="w")
        assert claimed is not None and claimed.rollout_id == ids[0]
        await client.add_span(span(claimed.rollout_id, claimed.attempt.attempt_id, 1))
        assert await stop(served.process, signal.SIGKILL) == -signal.SIGKILL
        await client.close()
        served.process = await start_server(served.place, served.url)
        client = LightningStoreClient(served.url)
        rollouts = await client.query_rollouts(rollout_id_in=ids, sort_by="start_time")
        assert [r.rollout_id for r in rollouts] == ids
        assert [r.status for r in rollouts] == ["running", "queuing", "queuing"]
        assert len(await client.query_spans(claimed.rollout_id)) == 1
        following = await client.dequeue_rollout()
        assert following is not None and following.rollout_id == ids[1]
    finally:
        await client.close()


async def drain(client: LightningStoreClient) -> None:
    while await client.dequeue_rollout() is not None:
        pass


async def test_a_token_guards_the_store(embedded_backend: Backend) -> None:
    """With AGL_STREAM_API_TOKEN: calls without it get a 401 that says what to send; the
    health check stays open; TokenStoreClient sends it."""
    from agl_stream.compat.agl import TokenStoreClient

    token = "store-token-0123456789"
    async with fresh_place(embedded_backend) as place:
        url = f"http://127.0.0.1:{free_port()}"
        process = await start_server(place, url, AGL_STREAM_API_TOKEN=token)
        try:
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{url}/v1/agl/statistics") as response:
                    assert response.status == 401
                    assert "AGL_STREAM_API_TOKEN" in (await response.json())["detail"]
                wrong = {"Authorization": "Bearer " + "x" * len(token)}
                async with http.get(f"{url}/v1/agl/statistics", headers=wrong) as response:
                    assert response.status == 401
            client = TokenStoreClient(url, token)
            try:
                rollout = await client.enqueue_rollout(input={"q": 1})
                assert (await client.get_rollout_by_id(rollout.rollout_id)) is not None
            finally:
                await client.close()
        finally:
            await stop(process)
