"""Topics, a database and an AglStreamStore shared by a module's tests (each store start joins a
consumer group and opens a transaction: seconds, not worth paying per test), and the scripted
LLM the agents of Agent Lightning's tests call."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import uuid
from asyncio.subprocess import PIPE, STDOUT
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import asyncpg
from aiohttp import web
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider

import agl_stream.compat.agl  # noqa: F401  (first: it imports Agent Lightning quietly)
from agl_stream.bus.kafka import admin_client
from agl_stream.bus.topic_admin import apply_topics
from agl_stream.db.migrate import migrate
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings, load
from tests.support import apo_world
from tests.support.backends import Backend

_tracer = TracerProvider().get_tracer("agl-store-tests")


async def run_script(
    *args: str, env: Mapping[str, str], cwd: Path, seconds: float
) -> tuple[int, str]:
    """Run a Python script to its end in a process of its own: its exit code and what it
    printed. One that outlives `seconds` is killed, not left running after the test.
    (`cwd`: Agent Lightning's AgentOps tracer writes agentops.log where it runs.)"""
    script = await asyncio.create_subprocess_exec(
        sys.executable, *args, env=dict(env), stdout=PIPE, stderr=STDOUT, cwd=cwd
    )
    try:
        output, _ = await asyncio.wait_for(script.communicate(), seconds)
    except TimeoutError:
        script.kill()
        await script.wait()
        raise
    assert script.returncode is not None
    return script.returncode, output.decode()


@dataclass(frozen=True)
class Place:
    kafka: KafkaSettings
    database: DatabaseSettings


@contextlib.asynccontextmanager
async def fresh_place(
    backend: Backend, database: DatabaseSettings | None = None
) -> AsyncIterator[Place]:
    """Topics of their own and a database of its own, removed afterwards (`database`: one of
    the caller's instead, migrated here and left to the caller)."""
    unique = uuid.uuid4().hex[:10]
    kafka = load(
        KafkaSettings,
        bootstrap_servers=backend.bootstrap_servers,
        topic_prefix=f"t{unique}.",
        replication_factor=backend.replication_factor,
    )
    await apply_topics(kafka)
    base = load(DatabaseSettings, database_url=backend.database_url)
    own = database is None
    database = base.with_database(f"test_{unique}") if database is None else database
    await migrate(database)
    try:
        yield Place(kafka, database)
    finally:
        if own:
            conn = await asyncpg.connect(base.with_database("postgres").asyncpg_dsn)
            try:
                await conn.execute(f'DROP DATABASE IF EXISTS "test_{unique}" WITH (FORCE)')
            finally:
                await conn.close()
        async with admin_client(kafka) as admin:
            names = [t for t in await admin.list_topics() if t.startswith(kafka.topic_prefix)]
            with contextlib.suppress(Exception):  # cleanup is best effort
                await asyncio.wait_for(admin.delete_topics(names), 10)


@dataclass(frozen=True)
class Endpoint:
    url: str
    app: web.Application


@contextlib.asynccontextmanager
async def rules_llm_endpoint(
    answer_key: dict[str, list[str]] | None = None,
) -> AsyncIterator[Endpoint]:
    """The tests' scripted rule-following model (tests/support/apo_world.py), on a free port."""
    app = apo_world.app(answer_key=answer_key)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        yield Endpoint(f"http://{host}:{port}/v1", app)
    finally:
        await runner.cleanup()


def otel_span(name: str = "step", **attributes: object) -> ReadableSpan:
    """A finished OpenTelemetry SDK span (a ReadableSpan), as a tracer hands one over."""
    span = _tracer.start_span(name, attributes=attributes)  # type: ignore[arg-type]
    span.end(end_time=time.time_ns())
    assert isinstance(span, ReadableSpan)
    return span
