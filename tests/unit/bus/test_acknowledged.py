"""A one-shot writer waits a bounded time for the brokers' acknowledgement (an idempotent
producer would retry without end) and then says so in a sentence."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka.errors import KafkaConnectionError

from agl_stream.bus.kafka import acknowledged, acknowledgement_seconds
from agl_stream.runtime.config import KafkaSettings, load


async def test_no_acknowledgement_within_two_request_timeouts_is_an_error_that_says_so() -> None:
    settings = load(KafkaSettings, bootstrap_servers="127.0.0.1:9", request_timeout_ms=1000)
    assert acknowledgement_seconds(settings) == 2.0
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    began = time.monotonic()
    with pytest.raises(KafkaConnectionError) as raised:
        await acknowledged(never, settings, "3 rollouts")
    assert 1.9 < time.monotonic() - began < 5
    assert never.cancelled()
    said = str(raised.value)
    assert "no broker acknowledged 3 rollouts within 2 s" in said
    assert "whether they were written is unknown" in said


async def test_an_acknowledgement_in_time_is_its_result() -> None:
    settings = load(KafkaSettings, bootstrap_servers="127.0.0.1:9", request_timeout_ms=1000)

    async def sent() -> int:
        await asyncio.sleep(0.01)
        return 7

    assert await acknowledged(sent(), settings) == 7
