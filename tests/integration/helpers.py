"""Small helpers for driving real consumers in tests."""

from __future__ import annotations

import asyncio
import time
import uuid
import warnings
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiokafka import AIOKafkaConsumer
from hypothesis import strategies as st
from hypothesis.errors import NonInteractiveExampleWarning

from agl_stream.events import Event

E = TypeVar("E", bound=Event)


def examples(strategy: st.SearchStrategy[E], n: int) -> list[E]:
    """n random events from a Hypothesis strategy, outside a @given test, each with an
    event id of its own (Hypothesis likes to repeat small UUIDs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonInteractiveExampleWarning)
        return [strategy.example().model_copy(update={"event_id": uuid.uuid4()}) for _ in range(n)]


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


async def wait_for_assignment(consumers: list[AIOKafkaConsumer], total: int, timeout: float = 60) -> None:
    """Poll every member until the group has settled with each member owning partitions."""

    async def settled() -> bool:
        for c in consumers:
            await c.getmany(timeout_ms=50)
        sizes = [len(c.assignment()) for c in consumers]
        return all(sizes) and sum(sizes) == total

    await eventually(settled, timeout, "the consumer group to settle")
