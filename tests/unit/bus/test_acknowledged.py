"""A one-shot writer waits a bounded time for the brokers' acknowledgement (an idempotent
producer would retry without end) and then says so in a sentence."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka.errors import KafkaConnectionError, KafkaError

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


async def test_a_sender_killed_by_a_closed_connection_is_said_as_a_lost_connection() -> None:
    """What aiokafka's sender raises when a broker stops mid-transaction (seen as the broker's
    disk filled): KafkaError("Unexpected error during batch delivery") from a KafkaError
    from the KafkaConnectionError."""
    settings = load(KafkaSettings, bootstrap_servers="127.0.0.1:9", request_timeout_ms=1000)

    async def dies() -> None:
        try:
            try:
                raise KafkaConnectionError("Connection at 127.0.0.1:9 closed")
            except KafkaConnectionError as closed:
                raise KafkaError(repr(closed)) from closed
        except KafkaError as exc:
            raise KafkaError("Unexpected error during batch delivery") from exc

    with pytest.raises(KafkaConnectionError) as raised:
        await acknowledged(dies(), settings, "the queue's progress")
    said = str(raised.value)
    assert "a broker's connection closed before it acknowledged the queue's progress" in said
    assert "Connection at 127.0.0.1:9 closed" in said
    assert "whether they were written is unknown" in said


async def test_other_kafka_errors_pass_through() -> None:
    settings = load(KafkaSettings, bootstrap_servers="127.0.0.1:9", request_timeout_ms=1000)

    async def refused() -> None:
        raise KafkaError("refused for another reason")

    with pytest.raises(KafkaError, match="another reason") as raised:
        await acknowledged(refused(), settings)
    assert not isinstance(raised.value, KafkaConnectionError)
