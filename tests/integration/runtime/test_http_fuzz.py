"""Every HTTP surface fuzzed against its description, on the real broker and database, with a
token configured: the store facade (FastAPI's own /openapi.json), the gateway and its reward
route, and the OTLP receiver (their descriptions as data: tests/support/http_specs.py), by
schemathesis, valid and invalid requests alike; OTLP protobuf bodies (random messages and
random bytes) by Hypothesis, to the receiver and to the store's /v1/traces. No answer is a 5xx
(the bare 500 with an error id must never happen for generated input), none carries a
traceback or a source path, and each server answers a legitimate request afterwards. (The
dashboard's API: test_dashboard_api_fuzz.py.)

Each run sends a few thousand requests; examples are derandomized, so CI repeats itself."""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from typing import Any

import hypothesis
import requests
import schemathesis
from aiohttp import web
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from schemathesis import GenerationMode

from agl_stream.agent.tracing import AttemptRecorder
from agl_stream.bus.kafka import producer
from agl_stream.bus.streams import EventPublisher, Topics
from agl_stream.compat.agl import AglStreamStore
from agl_stream.compat.agl.server import store_server
from agl_stream.embedded.process import free_port
from agl_stream.events import LLM
from agl_stream.gateway.proxy import Gateway
from agl_stream.otlp.ingest import OtlpIngest, OtlpReceiver
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings
from tests.support import http_specs

TOKEN = "fuzzing-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
INTERNALS = ("Traceback", 'File "', '.py"', "site-packages", "/agl_stream/")
Start = Callable[[], Awaitable[tuple[str, Callable[[], Awaitable[None]]]]]


@contextmanager
def serving(start: Start) -> Iterator[str]:
    """A server started by `start` on an event loop of its own in a thread (schemathesis
    calls synchronously): its base URL while the block runs."""
    loop = asyncio.new_event_loop()
    ready: asyncio.Future[str] = loop.create_future()
    stop = asyncio.Event()

    async def serve() -> None:
        try:
            url, close = await start()
        except BaseException as exc:
            ready.set_exception(exc)
            raise
        ready.set_result(url)
        try:
            await stop.wait()
        finally:
            await close()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    waiting = asyncio.run_coroutine_threadsafe(asyncio.wait_for(asyncio.shield(ready), 120), loop)
    try:
        yield waiting.result(timeout=150)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(60)
        loop.close()


def answered_plainly(what: str, status: int, text: str) -> None:
    assert status < 500, f"{what}: {status} {text[:2000]}"
    leaked = [marker for marker in INTERNALS if marker in text]
    assert not leaked, f"{what}: {status} shows {leaked}: {text[:2000]}"


def run(test: Callable[[], None]) -> None:
    with warnings.catch_warnings():
        # Hypothesis warns (an error here) when the `random` module's state moves while it
        # draws an example: the server's threads use it meanwhile, as schemathesis does.
        warnings.simplefilter("ignore", hypothesis.errors.HypothesisDeprecationWarning)
        test()


def fuzz(schema: schemathesis.BaseSchema, examples: int) -> Counter[int]:
    """Every operation of `schema`, valid and invalid input: the answers' statuses."""
    sent: Counter[int] = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in MODES:

            @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
            @hypothesis.settings(
                max_examples=examples, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(hypothesis.HealthCheck),
            )  # fmt: skip
            def survives(case: schemathesis.Case) -> None:
                response = case.call(timeout=30)
                sent[response.status_code] += 1
                answered_plainly(f"{case.method} {case.formatted_path}", response.status_code,
                                 response.text)  # fmt: skip

            try:
                run(survives)
            except hypothesis.errors.Unsatisfiable:
                continue  # nothing invalid to send (no parameters, free strings only)
    return sent


def described(spec: dict[str, Any] | str, base: str) -> schemathesis.BaseSchema:
    schema = (
        schemathesis.openapi.from_url(spec, headers=AUTH)
        if isinstance(spec, str)
        else schemathesis.openapi.from_dict(spec)
    )
    schema.config.update(base_url=base, headers=AUTH)
    return schema


# ---- OTLP protobuf bodies, by Hypothesis ------------------------------------------------------

_KEYS = st.sampled_from([
    "agl.rollout.id", "agl.attempt.id", "agl.attempt.key", "agl.rollout.mode",
    "agl.rollout.input", "agentlightning.rollout_id", "agentlightning.attempt_id",
    "agentlightning.span_sequence_id", "agl.reward",
]) | st.text(max_size=10)  # fmt: skip
_VALUES = st.one_of(
    st.builds(lambda s: AnyValue(string_value=s), st.text(max_size=20)),
    st.builds(
        lambda s: AnyValue(string_value=s), st.sampled_from(["otlp-x", "ro-1", "train", "{}"])
    ),
    st.builds(lambda i: AnyValue(int_value=i), st.integers(-(2**63), 2**63 - 1)),
    st.builds(lambda d: AnyValue(double_value=d), st.floats()),
    st.builds(lambda b: AnyValue(bool_value=b), st.booleans()),
    st.builds(lambda b: AnyValue(bytes_value=b), st.binary(max_size=8)),
)
_ATTRIBUTES = st.lists(st.builds(lambda k, v: KeyValue(key=k, value=v), _KEYS, _VALUES), max_size=4)
_IDS = st.binary(min_size=16, max_size=16) | st.binary(max_size=20)
_SPAN_IDS = st.binary(min_size=8, max_size=8) | st.binary(max_size=9)


@st.composite
def _span(draw: st.DrawFn) -> Span:
    return Span(
        trace_id=draw(_IDS), span_id=draw(_SPAN_IDS),
        parent_span_id=draw(st.binary(max_size=8)), name=draw(st.text(max_size=20)),
        kind=draw(st.integers(0, 5)), start_time_unix_nano=draw(st.integers(0, 2**64 - 1)),
        end_time_unix_nano=draw(st.integers(0, 2**64 - 1)), attributes=draw(_ATTRIBUTES),
    )  # fmt: skip


_EXPORTS = st.builds(
    lambda resources: ExportTraceServiceRequest(resource_spans=resources).SerializeToString(),
    st.lists(
        st.builds(
            lambda attributes, spans: ResourceSpans(
                resource=Resource(attributes=attributes), scope_spans=[ScopeSpans(spans=spans)]
            ),
            _ATTRIBUTES,
            st.lists(_span(), max_size=3),
        ),
        max_size=2,
    ),
) | st.binary(max_size=200)


def fuzz_protobuf(url: str, examples: int) -> Counter[int]:
    sent: Counter[int] = Counter()
    headers = {**AUTH, "Content-Type": "application/x-protobuf"}
    with requests.Session() as http:

        @hypothesis.given(body=_EXPORTS)
        @hypothesis.settings(
            max_examples=examples, deadline=None, derandomize=True, database=None,
            suppress_health_check=list(hypothesis.HealthCheck),
        )  # fmt: skip
        def survives(body: bytes) -> None:
            response = http.post(url, data=body, headers=headers, timeout=30)
            sent[response.status_code] += 1
            answered_plainly(f"POST {url}", response.status_code, response.text)

        run(survives)
    return sent


def _accepted(sent: Counter[int]) -> int:
    return sum(n for status, n in sent.items() if 200 <= status < 300)


# ---- the surfaces ----------------------------------------------------------------------------


def test_the_store_facade(kafka: KafkaSettings, database: DatabaseSettings) -> None:
    async def start() -> tuple[str, Callable[[], Awaitable[None]]]:
        facade = AglStreamStore(kafka, database)
        await facade.statistics()
        server = store_server(facade, "127.0.0.1", free_port(), token=TOKEN)
        with warnings.catch_warnings():
            # Agent Lightning's models warn that a default is not JSON (status_in=None):
            # FastAPI keeps the description it builds here, as it would at the first call.
            warnings.simplefilter("ignore")
            server.app.openapi()
        await server.start()

        async def close() -> None:
            await server.stop()
            await facade.aclose()

        return str(server.endpoint), close

    with serving(start) as base:
        schema = described(f"{base}/openapi.json", base).exclude(
            # waits: a generated timeout holds the call for as long as it says; the other
            # OTLP signals: Agent Lightning answers 501 (not implemented) to anything.
            path_regex="^/v1/(agl/waits/rollouts|metrics|logs|development/profiles)$"
        )
        sent = fuzz(schema, examples=30) + fuzz_protobuf(f"{base}/v1/traces", examples=200)
        print(f"the store: {sorted(sent.items())}")  # (shown with -s)
        assert sent.total() >= 1200 and _accepted(sent) >= 200 and sent[400] >= 300, sent
        alive = requests.post(
            f"{base}/v1/agl/rollouts", json={"input": 1}, headers=AUTH, timeout=30
        )
        assert alive.status_code == 201, alive.text


@asynccontextmanager
async def _upstream() -> AsyncIterator[str]:
    """An OpenAI-compatible upstream that answers every call the same way."""

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        if request.path.endswith("/models"):
            return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop", "logprobs": None}
        if request.path.endswith("/chat/completions"):
            choice["message"] = {"role": "assistant", "content": "ok"}
        else:
            choice["text"] = "ok"
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        return web.json_response({"id": "x", "object": "chat.completion", "created": 0,
                                  "model": "m", "choices": [choice], "usage": usage})  # fmt: skip

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    finally:
        await runner.cleanup()


def test_the_gateway_and_its_reward_route(kafka: KafkaSettings) -> None:
    async def start() -> tuple[str, Callable[[], Awaitable[None]]]:
        stack = AsyncExitStack()
        prod = await stack.enter_async_context(producer(kafka))
        upstream = await stack.enter_async_context(_upstream())
        gateway = Gateway(
            upstream, publisher=EventPublisher(prod, Topics(kafka)), reward_token=TOKEN,
            token=TOKEN,
        )  # fmt: skip
        url = await gateway.start()
        stack.push_async_callback(gateway.stop)
        recorder = AttemptRecorder(http_specs.FUZZ_ROLLOUT, http_specs.FUZZ_ATTEMPT)
        llm = LLM(endpoint=upstream, model="m")
        gateway.open_attempt(recorder, {http_specs.FUZZ_RESOURCE: llm}, None)
        return url, stack.aclose

    with serving(start) as base:
        sent = fuzz(described(http_specs.GATEWAY, base), examples=60)
        print(f"the gateway: {sorted(sent.items())}")
        assert sent.total() >= 600 and _accepted(sent) >= 100 and sent[400] >= 50, sent
        reward = {"rollout_id": "ro-1", "value": 1.0}
        alive = requests.post(f"{base}/rewards", json=reward, headers=AUTH, timeout=30)
        assert alive.status_code == 200, alive.text


def test_the_otlp_receiver(kafka: KafkaSettings) -> None:
    async def start() -> tuple[str, Callable[[], Awaitable[None]]]:
        stack = AsyncExitStack()
        prod = await stack.enter_async_context(producer(kafka))
        receiver = OtlpReceiver(OtlpIngest(EventPublisher(prod, Topics(kafka)), TOKEN), TOKEN)
        url = await receiver.start(port=0)
        stack.push_async_callback(receiver.stop)
        return url, stack.aclose

    with serving(start) as base:
        sent = fuzz(described(http_specs.OTLP_RECEIVER, base), examples=150)
        sent += fuzz_protobuf(f"{base}/v1/traces", examples=400)
        print(f"the OTLP receiver: {sorted(sent.items())}")
        assert sent.total() >= 600 and _accepted(sent) >= 50 and sent[400] >= 100, sent
        alive = requests.get(f"{base}/metrics", headers=AUTH, timeout=30)
        assert alive.status_code == 200 and "agl_stream_otlp_payloads_total" in alive.text
