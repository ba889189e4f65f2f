"""The standalone gateway's span pump: a failed send keeps its batch and the pump goes on;
a backlog past the bound refuses new calls with a reason instead of growing."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiokafka.errors import KafkaConnectionError
from opentelemetry.sdk.trace import TracerProvider

from agl_stream.events import SpanRecorded
from agl_stream.gateway import proxy
from agl_stream.gateway.proxy import Gateway
from agl_stream.runtime.supervision import restarting


class FlakyPublisher:
    """Fails the first `failures` sends, then keeps what it is sent."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.sent: list[SpanRecorded] = []

    async def send(self, topic: str, event: SpanRecorded) -> asyncio.Future[None]:
        if self.failures > 0:
            self.failures -= 1
            raise KafkaConnectionError("the broker is gone")
        self.sent.append(event)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


async def _until_sent(publisher: FlakyPublisher, count: int) -> None:
    """Wait (up to about 3 s) until the publisher has been sent `count` spans."""
    for _ in range(300):
        if len(publisher.sent) >= count:
            return
        await asyncio.sleep(0.01)


def _record(gateway: Gateway, count: int) -> None:
    tracer = TracerProvider().get_tracer("test")
    for i in range(count):
        with tracer.start_as_current_span(f"call {i}") as span:
            pass
        gateway.log.record(span)  # type: ignore[arg-type]


async def test_a_failed_send_keeps_its_batch_and_the_pump_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(proxy, "PUMP_SECONDS", 0.01)
    monkeypatch.setattr(
        proxy, "restarting", lambda work, what: restarting(work, what, first=0.01, cap=0.02)
    )
    publisher = FlakyPublisher(failures=2)
    gateway = Gateway(publisher=publisher)  # type: ignore[arg-type]
    await gateway.start()
    try:
        _record(gateway, 5)
        await _until_sent(publisher, 5)
        _record(gateway, 3)  # the pump still runs after the failures
        await _until_sent(publisher, 8)
    finally:
        await gateway.stop()
    assert [e.sequence for e in publisher.sent] == list(range(8))
    assert gateway.counts["span_batches_failed"] == 2


async def test_a_backlog_past_the_bound_refuses_calls_with_a_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(proxy, "MAX_WAITING_SPANS", 3)
    monkeypatch.setattr(proxy, "PUMP_SECONDS", 3600)  # nothing is sent meanwhile
    gateway = Gateway(default_upstream="http://127.0.0.1:9/v1", publisher=FlakyPublisher(0))  # type: ignore[arg-type]
    url = await gateway.start()
    try:
        _record(gateway, 4)
        async with aiohttp.ClientSession() as session:
            body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                assert response.status == 503
                answer = await response.json()
    finally:
        gateway.publisher = None  # the backlog is not the point here
        await gateway.stop()
    assert "4 recorded calls are waiting to reach the broker" in answer["error"]["message"]


class SizeLimited(FlakyPublisher):
    """Refuses what aiokafka refuses: a record over the request size."""

    async def send(self, topic: str, event: SpanRecorded) -> asyncio.Future[None]:
        from aiokafka.errors import MessageSizeTooLargeError

        from agl_stream.bus.codec import Codec

        if len(Codec().encode(event)) > 1_000_000:
            raise MessageSizeTooLargeError("too large")
        return await super().send(topic, event)


async def test_a_span_too_large_goes_as_a_stand_in_and_blocks_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It went back to the front of the log after every try, forever, and everything
    behind it waited (the review's poison span)."""
    monkeypatch.setattr(proxy, "PUMP_SECONDS", 0.01)
    publisher = SizeLimited(failures=0)
    gateway = Gateway(publisher=publisher)  # type: ignore[arg-type]
    await gateway.start()
    try:
        tracer = TracerProvider().get_tracer("test")
        with tracer.start_as_current_span("huge", attributes={"blob": "x" * 2_000_000}) as span:
            pass
        gateway.log.record(span)  # type: ignore[arg-type]
        _record(gateway, 2)
        await _until_sent(publisher, 3)
    finally:
        await gateway.stop()
    assert [e.sequence for e in publisher.sent] == [0, 1, 2]  # each once
    assert "over the record limit" in str(publisher.sent[0].attributes["agl.span.too_large"])
    assert gateway.counts["spans_too_large"] == 1
