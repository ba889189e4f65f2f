"""`retrying` tries again what a moving cluster fails, and nothing else."""

from __future__ import annotations

import pytest
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    NodeNotReadyError,
    TopicAuthorizationFailedError,
)

from agl_stream.bus.kafka import retrying


async def test_a_wait_that_ran_out_is_tried_again() -> None:
    """A long-lived client whose metadata names a broker that went silent (the runner's
    fold reader asking for end offsets) fails with KafkaTimeoutError until its metadata is
    refreshed; aiokafka does not mark it retriable."""
    failures = [KafkaTimeoutError("Failed to get offsets in 10000 ms"), NodeNotReadyError()]

    async def attempt() -> int:
        if failures:
            raise failures.pop(0)
        return 7

    assert await retrying(attempt, "the end offsets", within=5) == 7
    assert failures == []


async def test_an_error_that_trying_again_cannot_fix_is_raised_at_once() -> None:
    calls = 0

    async def attempt() -> int:
        nonlocal calls
        calls += 1
        raise TopicAuthorizationFailedError()

    with pytest.raises(TopicAuthorizationFailedError):
        await retrying(attempt, "the end offsets", within=5)
    assert calls == 1


async def test_an_error_the_caller_picks_out_is_raised_at_once() -> None:
    """`topics apply` against brokers that never accepted its first client reports them at
    once: a retriable error, but nothing is up to wait for."""
    calls = 0

    async def attempt() -> int:
        nonlocal calls
        calls += 1
        raise KafkaConnectionError("Unable to bootstrap from [('127.0.0.1', 9)]")

    with pytest.raises(KafkaConnectionError):
        await retrying(attempt, "applying the topics", within=5, unless=lambda _: calls == 1)
    assert calls == 1
