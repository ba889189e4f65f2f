"""Issue 31's reproductions, on the real broker and database; each failed before the fix.

The store facade (Agent Lightning's server over AglStreamStore): ids with a NUL or of 300
characters in a path, a query or a body are a 400 naming them (they were 500s with Python
tracebacks); an unknown rollout a 404 (a ResponseValidationError's 500); an input too large for
one Kafka record a 413 naming the limit (aiokafka's MessageSizeTooLargeError, a 500), after
which the store goes on; an integer the read model cannot hold (2**70) a 400 (the store said
201, then the projector dead-lettered the record); a body over the store's limit a 413 before
it is read (120 MB were taken), a gzip bomb too; its /v1/traces behind the token. The OTLP
receiver: `agl-stream ingest otlp` with AGL_STREAM_API_TOKEN set asks for it, /metrics too (it
was open); a span naming a runner's finished attempt is refused (an `agl.reward` of -100 was
added to one, which then counted 4 spans against 3), and joins it only with the attempt's
key."""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from yarl import URL

from agl_stream.bus.kafka import producer
from agl_stream.bus.streams import EventPublisher, Topics
from agl_stream.compat.agl import AglStreamStore, TokenStoreClient
from agl_stream.compat.agl.guard import MAX_BODY
from agl_stream.compat.agl.server import store_server
from agl_stream.embedded.process import free_port
from agl_stream.otlp.ingest import OtlpIngest, OtlpReceiver
from agl_stream.otlp.mapping import attempt_key
from agl_stream.queries import ReadModel
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings, child_environment
from tests.support.agl_fixtures import fresh_place
from tests.support.backends import Backend
from tests.support.helpers import eventually
from tests.support.otlp_payloads import request, span
from tests.support.projection import caught_up, ends, projector_in_process
from tests.support.runs import queue, runner_in_process

TOKEN = "hostile-input-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TRACE = 0x5BF92F3577B34DA6A3CE929D0E0E4736


@pytest.fixture(scope="module")
async def store_url(embedded_backend: Backend) -> AsyncIterator[str]:
    async with fresh_place(embedded_backend) as place:
        facade = AglStreamStore(place.kafka, place.database)
        server = store_server(facade, "127.0.0.1", free_port(), token=TOKEN)
        await server.start()
        try:
            yield str(server.endpoint)
        finally:
            await server.stop()
            await facade.aclose()


async def _call(
    http: aiohttp.ClientSession, method: str, url: str, body: Any = None
) -> tuple[int, str]:
    # (a stream: aiohttp warns of raw bytes over 1 MiB, and warnings are errors here)
    data = None if body is None else io.BytesIO(json.dumps(body).encode())
    headers = {**AUTH, "Content-Type": "application/json"}
    async with http.request(method, URL(url, encoded=True), data=data, headers=headers) as r:
        return r.status, await r.text()


@pytest.mark.parametrize(
    ("method", "path", "body", "says"),
    [
        ("GET", "/v1/agl/rollouts/ro%00x", None, "rollout_id must hold printable characters"),
        ("GET", "/v1/agl/rollouts?rollout_id_contains=%00", None, "rollout_id_contains must"),
        ("GET", "/v1/agl/rollouts?rollout_id_in=a%00", None, "rollout_id_in must"),
        ("POST", "/v1/agl/queues/rollouts/dequeue", {"worker_id": "w\x00"}, "worker_id must"),
        ("GET", "/v1/agl/workers/w%00", None, "worker_id must hold printable"),
        ("POST", "/v1/agl/workers/w%00", {}, "worker_id must hold printable"),
        ("POST", "/v1/agl/rollouts", {"input": 1, "worker_id": "w\x00"}, "worker_id must"),
        ("GET", f"/v1/agl/rollouts/{'r' * 300}", None, "at most 256 characters"),
        ("GET", "/v1/agl/spans?rollout_id=ro&name=a%00", None, "NUL character"),
        ("POST", "/v1/agl/rollouts/search", {"rollout_id_contains": "\x00"}, "contains must"),
        # A number Python's JSON takes and the read model's does not (the projector dead-letters
        # the record: the store answered 201 for a rollout it would never show).
        ("POST", "/v1/agl/rollouts", {"input": {"n": 2**70}}, "does not fit 64 bits"),
    ],
)
async def test_bad_ids_are_a_400_that_names_them(
    store_url: str, method: str, path: str, body: Any, says: str
) -> None:
    async with aiohttp.ClientSession() as http:
        status, text = await _call(http, method, f"{store_url}{path}", body)
    assert status == 400, text
    assert says in json.loads(text)["detail"]
    assert "Traceback" not in text and ".py" not in text


async def test_an_unknown_rollout_is_a_404_with_the_reason(store_url: str) -> None:
    async with aiohttp.ClientSession() as http:
        status, text = await _call(http, "GET", f"{store_url}/v1/agl/rollouts/ro-missing")
    assert status == 404, text
    assert json.loads(text) == {"detail": "rollout 'ro-missing' does not exist"}
    client = TokenStoreClient(store_url, TOKEN)  # Agent Lightning's client: None, at once
    try:
        assert await asyncio.wait_for(client.get_rollout_by_id("ro-missing"), 10) is None
    finally:
        await client.close()


async def test_an_input_too_large_for_the_broker_is_a_413_and_the_store_goes_on(
    store_url: str,
) -> None:
    async with aiohttp.ClientSession() as http:
        big = {"input": "x" * 2_000_000}
        status, text = await _call(http, "POST", f"{store_url}/v1/agl/rollouts", big)
        assert status == 413, text
        assert "1,048,576 bytes" in json.loads(text)["detail"]
        status, text = await _call(http, "POST", f"{store_url}/v1/agl/rollouts", {"input": 1})
        assert status == 201, text


async def test_a_body_over_the_limit_is_refused_before_it_is_read(store_url: str) -> None:
    """A Content-Length of 120 MB (nothing more sent) is answered at once; a gzip body that
    would inflate past the limit stops at it."""
    url = URL(store_url)
    reader, writer = await asyncio.open_connection(url.host, url.port)
    try:
        writer.write(
            b"POST /v1/agl/rollouts HTTP/1.1\r\nHost: store\r\n"
            b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: 125829120\r\n\r\n"
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 413"), head
        length = int(
            next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(
                b":"
            )[1]
        )
        body = json.loads(await reader.readexactly(length))
        assert f"at most {MAX_BODY:,} bytes" in body["detail"]
    finally:
        writer.close()
    bomb = gzip.compress(b"\0" * (MAX_BODY + 1))  # about 65 KB on the wire
    headers = {**AUTH, "Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{store_url}/v1/traces", data=bomb, headers=headers) as r,
    ):
        assert r.status == 413 and "inflated" in (await r.json())["detail"]


async def test_the_stores_traces_route_needs_the_token(store_url: str) -> None:
    body = request([span(TRACE, 1, "x")]).SerializeToString()
    headers = {"Content-Type": "application/x-protobuf"}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{store_url}/v1/traces", data=body, headers=headers) as r:
            assert r.status == 401
        async with http.post(f"{store_url}/v1/traces", data=body, headers={**headers, **AUTH}) as r:
            assert r.status == 200  # (no agentlightning ids: nothing to keep, as in AGL)


# ---- the OTLP receiver -----------------------------------------------------------------------


async def test_ingest_otlp_takes_the_api_token(kafka: KafkaSettings) -> None:
    """The deployment's AGL_STREAM_API_TOKEN, and no AGL_STREAM_OTLP_TOKEN: the receiver's
    traces and metrics need it (they answered anyone); /health stays open."""
    port = free_port()
    env = {**child_environment(kafka), "AGL_STREAM_API_TOKEN": TOKEN}
    env.pop("AGL_STREAM_OTLP_TOKEN", None)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agl_stream.cli.main", "ingest", "otlp", "--port", str(port),
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    proto = {"Content-Type": "application/x-protobuf"}
    body = request([span(TRACE, 1, "cli")]).SerializeToString()
    try:
        async with aiohttp.ClientSession() as http:

            async def up() -> bool:
                assert process.returncode is None
                try:
                    async with http.get(f"{base}/metrics"):
                        return True
                except aiohttp.ClientConnectionError:
                    return False

            await eventually(up, 60, "the receiver")
            async with http.get(f"{base}/health") as r:
                assert r.status == 200
            async with http.post(f"{base}/v1/traces", data=body, headers=proto) as r:
                assert r.status == 401
            async with http.get(f"{base}/metrics") as r:
                assert r.status == 401
            async with http.post(f"{base}/v1/traces", data=body, headers={**proto, **AUTH}) as r:
                assert r.status == 200, await r.text()
            async with http.get(f"{base}/metrics", headers=AUTH) as r:
                assert r.status == 200 and "agl_stream_otlp_spans_total 1.0" in await r.text()
    finally:
        process.terminate()
        await asyncio.wait_for(process.communicate(), 30)


async def test_an_ingested_span_joins_a_runners_attempt_only_with_its_key(
    kafka: KafkaSettings, database: DatabaseSettings
) -> None:
    async with projector_in_process(kafka, database), runner_in_process(kafka):
        (rollout_id,) = await queue(kafka, [{"spans": 3}], mode="train")
        async with ReadModel.open(database) as model:
            await model.wait_for_rollouts([rollout_id], within=60)
            (attempt,) = await model.attempts(rollout_id)
    assert attempt.status == "succeeded" and attempt.complete
    ids = {"agl.rollout.id": rollout_id, "agl.attempt.id": attempt.attempt_id}
    poison = request([span(TRACE, 7, "hostile.reward", **ids, **{"agl.reward": -100.0})])
    key = attempt_key(TOKEN, rollout_id, attempt.attempt_id)
    keyed = request([span(TRACE, 8, "late.tool", **ids, **{"agl.attempt.key": key})])
    headers = {**AUTH, "Content-Type": "application/x-protobuf"}
    async with producer(kafka) as prod:
        receiver = OtlpReceiver(OtlpIngest(EventPublisher(prod, Topics(kafka)), TOKEN), TOKEN)
        url = f"{await receiver.start(port=0)}/v1/traces"
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(url, data=poison.SerializeToString(), headers=headers) as r:
                    assert r.status == 400
                    assert "which no OTLP ingester started" in (await r.json())["message"]
                async with http.post(url, data=keyed.SerializeToString(), headers=headers) as r:
                    assert r.status == 200, await r.text()
        finally:
            await receiver.stop()
    async with projector_in_process(kafka, database):
        wanted = await ends(kafka)
        await eventually(lambda: caught_up(database, wanted), 60, "the projector")
    async with ReadModel.open(database) as model:
        spans = await model.spans(rollout_id)
        assert "hostile.reward" not in [s.name for s in spans]
        assert [s.name for s in spans].count("late.tool") == 1
        (after,) = await model.attempts(rollout_id)  # and no attempt of the ingester's
        assert after.attempt_id == attempt.attempt_id
        assert (after.span_count, after.spans_received) == (
            attempt.span_count, attempt.spans_received + 1,  # the keyed one alone
        )  # fmt: skip
        (late,) = [s for s in spans if s.name == "late.tool"]
        assert key not in json.dumps(late.model_dump(mode="json"))
