"""Small helpers for driving real consumers in tests."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from aiokafka import AIOKafkaConsumer
from click.testing import CliRunner, Result
from hypothesis import strategies as st
from hypothesis.errors import NonInteractiveExampleWarning

from agl_stream.bus.streams import ConsumedEvent, EventStream
from agl_stream.events import Event
from agl_stream.runtime.config import KafkaSettings, child_environment

E = TypeVar("E", bound=Event)


def examples(strategy: st.SearchStrategy[E], n: int) -> list[E]:
    """n random events from a Hypothesis strategy, outside a @given test, each with an
    event id of its own (Hypothesis likes to repeat small UUIDs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonInteractiveExampleWarning)
        return [strategy.example().model_copy(update={"event_id": uuid.uuid4()}) for _ in range(n)]


async def eventually(check: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {within} s waiting for {what}")


async def wait_for_assignment(
    consumers: list[AIOKafkaConsumer], total: int, within: float = 60
) -> None:
    """Poll every member until the group has settled with each member owning partitions."""

    async def settled() -> bool:
        for c in consumers:
            await c.getmany(timeout_ms=50)
        sizes = [len(c.assignment()) for c in consumers]
        return all(sizes) and sum(sizes) == total

    await eventually(settled, within, "the consumer group to settle")


async def invoke_cli(*args: str) -> Result:
    """Run the CLI as a user would, off the test's event loop (commands run their own)."""
    from agl_stream.cli.main import cli

    return await asyncio.to_thread(CliRunner().invoke, cli, list(args))


@contextlib.asynccontextmanager
async def cli_process(
    kafka: KafkaSettings, *args: str
) -> AsyncIterator[asyncio.subprocess.Process]:
    """`agl-stream ARGS` as a process on these topics (its output dropped), stopped with
    SIGTERM at the end unless the test ended it otherwise."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agl_stream.cli.main", *args, env=child_environment(kafka),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield process
    finally:
        if process.returncode is None:
            process.terminate()
            await asyncio.wait_for(process.wait(), 30)


def traversable(path: Path) -> Path:
    """pytest's temporary directories are private (0700); PostgreSQL runs as another user
    when the tests run as root, so let it walk in (o+x, nothing readable)."""
    path.mkdir(parents=True, exist_ok=True)
    for directory in [path, *path.parents]:
        if directory == Path(tempfile.gettempdir()) or directory == directory.parent:
            break
        directory.chmod(directory.stat().st_mode | 0o001)
    return path


async def collect(
    stream: EventStream, count: int, within: float = 60, commit: bool = True
) -> list[ConsumedEvent]:
    """Read from a stream until `count` events arrived, committing each batch."""
    got: list[ConsumedEvent] = []

    async def enough() -> bool:
        batch = await stream.next_batch(timeout_ms=100)
        got.extend(batch)
        if commit:
            await stream.commit(batch)
        return len(got) >= count

    await eventually(enough, within, f"{count} events")
    return got
