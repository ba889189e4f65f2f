"""Integration fixtures: a backend per session; per test, fresh topics and a fresh database."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest

from agl_stream.bus.kafka import admin_client, retrying
from agl_stream.bus.topic_admin import apply_topics
from agl_stream.db.migrate import migrate
from agl_stream.embedded import kafka_dist, registry_dist
from agl_stream.embedded.process import StackError, free_port, stop
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings, load
from tests.support import backends
from tests.support.backends import Backend
from tests.support.helpers import traversable


@pytest.fixture(scope="session")
def embedded_backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    with backends.embedded(traversable(tmp_path_factory.mktemp("stack"))) as backend:
        yield backend


@pytest.fixture(scope="session")
def cluster_backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    """A 3-node Kafka cluster (tests that kill brokers ask for it by name)."""
    with backends.cluster(traversable(tmp_path_factory.mktemp("cluster"))) as backend:
        yield backend


@pytest.fixture(scope="session")
def testcontainers_backend() -> Iterator[Backend]:
    reason = backends.docker_available()
    if reason is not None:
        pytest.skip(f"testcontainers backend: {reason}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with backends.testcontainers() as backend:
            yield backend


@pytest.fixture(scope="session", params=["embedded", "testcontainers"])
def backend(request: pytest.FixtureRequest) -> Backend:
    """Every test that takes `backend` runs on each backend that exists here."""
    return request.getfixturevalue(f"{request.param}_backend")


@pytest.fixture(scope="session")
def schema_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One Apicurio Registry for the session (in memory; each test's topics give it subjects
    of their own): the URL of its Confluent API. Built by `make install` where Maven exists
    (here, on first use, if not); skips, saying why, without Java or Maven."""
    try:
        kafka_dist.java_binary()
    except StackError as exc:
        pytest.skip(f"no schema registry: {exc}")
    if not registry_dist.installed() and shutil.which("mvn") is None:
        pytest.skip(
            "no schema registry: it is not built and Maven (mvn), which builds it, is not "
            "installed; install Maven and run `make registry`"
        )
    port = free_port()
    pid = registry_dist.start(port, tmp_path_factory.mktemp("registry") / "registry.log")
    try:
        yield registry_dist.url(port)
    finally:
        stop(pid, 10.0)


@pytest.fixture
def unique() -> str:
    return uuid.uuid4().hex[:10]


@pytest.fixture
async def kafka(backend: Backend, unique: str) -> AsyncIterator[KafkaSettings]:
    """Settings with a topic prefix of its own; the topics exist."""
    settings = load(
        KafkaSettings,
        bootstrap_servers=backend.bootstrap_servers,
        topic_prefix=f"t{unique}.",
        replication_factor=backend.replication_factor,
    )
    await apply_topics(settings)
    yield settings

    # Retried like any admin call: a test that froze the broker leaves it answering
    # NodeNotReady for a moment after it thaws (that ended a CI run in this teardown).
    async def cleanup() -> None:
        async with admin_client(settings) as admin:
            listed = await admin.list_topics()
            names = [t for t in listed if t.startswith(settings.topic_prefix)]
            with contextlib.suppress(Exception):  # deleting is best effort
                await asyncio.wait_for(admin.delete_topics(names), 10)

    await retrying(cleanup, "deleting the test's topics")


@pytest.fixture
async def database(backend: Backend, unique: str) -> AsyncIterator[DatabaseSettings]:
    """A fresh database of its own, migrated to head; dropped afterwards."""
    base = load(DatabaseSettings, database_url=backend.database_url)
    settings = base.with_database(f"test_{unique}")
    await migrate(settings)
    yield settings
    conn = await asyncpg.connect(base.with_database("postgres").asyncpg_dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "test_{unique}" WITH (FORCE)')
    finally:
        await conn.close()
