"""Configuration mistakes against a real PostgreSQL stop a command with a sentence that names
the setting, never a traceback (issue 31): a database that does not exist, a user it does
not know, a database not migrated, a read-model name that is not a new read model, an empty
enqueue key. tests/unit/cli/test_cli_mistakes.py has those that need no server."""

from __future__ import annotations

import asyncio
import sys

import asyncpg
import pytest
from aiokafka import TopicPartition
from click.testing import CliRunner, Result

from agl_stream.bus.kafka import end_offsets
from agl_stream.bus.streams import Topics
from agl_stream.cli.main import cli
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings, child_environment, load
from tests.support.backends import Backend

# Commands that read the database first (cancel and requeue look the ids up).
READERS = [
    ["db", "current"], ["query", "rollouts"], ["query", "read-models"], ["query", "lag"],
    ["cancel", "ro-1"], ["requeue", "ro-1"], ["export"],
]  # fmt: skip


async def invoke(
    args: list[str], env: dict[str, str] | None = None, stdin: str | None = None
) -> Result:
    """The CLI as a person runs it, off the test's event loop (commands run their own)."""
    return await asyncio.to_thread(CliRunner().invoke, cli, args, input=stdin, env=env)


def said(result: Result, code: int) -> str:
    """The output on one line, once the command exited with `code` on its own (an exception
    that CliRunner caught would have been a traceback)."""
    assert isinstance(result.exception, SystemExit), (result.exception, result.output)
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return " ".join(result.output.split())


def _with_password(url: str, password: str) -> str:
    return url.replace("://agl@", f"://agl:{password}@", 1)  # trust auth: never checked


async def _create_database(backend: Backend, name: str) -> DatabaseSettings:
    base = load(DatabaseSettings, database_url=backend.database_url)
    conn = await asyncpg.connect(base.with_database("postgres").asyncpg_dsn)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return base.with_database(name)


async def _drop_database(backend: Backend, name: str) -> None:
    base = load(DatabaseSettings, database_url=backend.database_url)
    conn = await asyncpg.connect(base.with_database("postgres").asyncpg_dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


@pytest.mark.parametrize("args", READERS, ids=" ".join)
async def test_a_database_that_does_not_exist_is_named(
    backend: Backend, unique: str, args: list[str]
) -> None:
    base = load(DatabaseSettings, database_url=backend.database_url)
    url = _with_password(base.with_database(f"nodb_{unique}").asyncpg_dsn, "s3cret")
    text = said(await invoke(args, {"AGL_STREAM_DATABASE_URL": url}), 1)
    shown = url.replace(":s3cret@", ":***@")
    assert f'AGL_STREAM_DATABASE_URL ({shown}): database "nodb_{unique}" does not exist' in text
    assert "`agl-stream db upgrade`, which creates it" in text
    assert "s3cret" not in text


@pytest.mark.parametrize("args", READERS, ids=" ".join)
async def test_a_user_the_database_does_not_know_is_named(
    database: DatabaseSettings, args: list[str]
) -> None:
    url = database.asyncpg_dsn.replace("://agl@", "://nobody_here@", 1)
    text = said(await invoke(["--database-url", url, *args]), 1)
    assert f'--database-url ({url}): role "nobody_here" does not exist' in text
    assert "check the user name in the URL" in text


@pytest.mark.parametrize("args", [a for a in READERS if a != ["db", "current"]], ids=" ".join)
async def test_a_database_not_migrated_says_how_to_migrate_it(
    backend: Backend, kafka: KafkaSettings, unique: str, args: list[str]
) -> None:
    name = f"bare_{unique}"
    bare = await _create_database(backend, name)
    try:
        result = await invoke(
            ["--bootstrap-servers", kafka.bootstrap_servers, "--topic-prefix",
             kafka.topic_prefix, *args],
            {"AGL_STREAM_DATABASE_URL": bare.asyncpg_dsn},
        )  # fmt: skip
        text = said(result, 1 if args[0] != "export" else 2)
        if args[0] != "export":  # export says it in words of its own, without the URL
            assert f"AGL_STREAM_DATABASE_URL ({bare.display_url()}): relation" in text
        assert 'read_models" does not exist' in text and "`agl-stream db upgrade`" in text
    finally:
        await _drop_database(backend, name)


@pytest.mark.parametrize(
    "args", [["db", "current"], ["query", "rollouts"], ["query", "read-models"]], ids=" ".join
)
async def test_url_parameters_mean_what_asyncpg_says_in_every_command(
    database: DatabaseSettings, args: list[str]
) -> None:
    # SQLAlchemy passed them to asyncpg.connect as keywords: TypeError: unexpected 'sslmode'.
    url = f"{database.asyncpg_dsn}?sslmode=disable&application_name=agl-test"
    result = await invoke(["--database-url", url, *args])
    assert result.exit_code == 0 and result.exception is None, (result.exception, result.output)
    unknown = await invoke(["--database-url", f"{database.asyncpg_dsn}?bogus=1", *args])
    text = said(unknown, 1)
    assert 'PostgreSQL refused: unrecognized configuration parameter "bogus"' in text


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("pg_catalog", "cannot name a read model"),
        ("pg_toast", "cannot name a read model"),
        ("information_schema", "cannot name a read model"),
        ("public", "cannot name a read model"),
        ("app_data", "the database has a schema named 'app_data' that is not a read model"),
        ("read_model_1", "a read model named 'read_model_1' exists already"),
    ],
)
async def test_replay_builds_only_a_new_read_model(
    kafka: KafkaSettings, database: DatabaseSettings, name: str, problem: str
) -> None:
    conn = await asyncpg.connect(database.asyncpg_dsn)
    try:
        await conn.execute("CREATE SCHEMA app_data; CREATE TABLE app_data.orders (id int)")
        result = await invoke(
            ["--bootstrap-servers", kafka.bootstrap_servers, "--topic-prefix", kafka.topic_prefix,
             "--database-url", database.asyncpg_dsn, "replay", "--name", name],
        )  # fmt: skip
        text = said(result, 2)
        assert "--name" in text and problem in text
        tables = await conn.fetch(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'app_data'"
        )
        assert [r["table_name"] for r in tables] == ["orders"]  # nothing migrated into it
        models = await conn.fetch("SELECT name FROM read_models ORDER BY name")
        assert [r["name"] for r in models] == ["read_model_1"]
    finally:
        await conn.close()


async def test_an_empty_enqueue_key_queues_nothing(kafka: KafkaSettings) -> None:
    result = await invoke(
        ["--bootstrap-servers", kafka.bootstrap_servers, "--topic-prefix", kafka.topic_prefix,
         "enqueue", "--key", ""],
        stdin='{"q": 1}\n',
    )  # fmt: skip
    assert "--key: an empty key names nothing" in said(result, 2)
    topics = Topics(kafka)
    partitions = range(topics.specs["tasks"].partitions)
    tasks = [TopicPartition(topics.name("tasks"), p) for p in partitions]
    assert sum((await end_offsets(kafka, tasks)).values()) == 0


async def test_a_projector_on_a_database_not_migrated_stops_with_a_sentence(
    backend: Backend, kafka: KafkaSettings, unique: str
) -> None:
    # A process of its own: a worker installs signal handlers, which a thread cannot.
    name = f"bare_{unique}"
    bare = await _create_database(backend, name)
    try:
        env = {**child_environment(kafka, bare), "COLUMNS": "400"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agl_stream.cli.main", "worker", "projector",
            env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        output = (await asyncio.wait_for(proc.communicate(), 60))[0].decode()
        assert proc.returncode == 1, output
        assert "Traceback" not in output
        text = " ".join(output.split())
        assert (
            f'AGL_STREAM_DATABASE_URL ({bare.display_url()}): relation "public.read_models"' in text
        )
        assert "`agl-stream db upgrade`" in text
    finally:
        await _drop_database(backend, name)


async def test_status_says_why_the_database_cannot_be_used(backend: Backend, unique: str) -> None:
    base = load(DatabaseSettings, database_url=backend.database_url)
    url = base.with_database(f"nodb_{unique}").asyncpg_dsn
    env = {
        "AGL_STREAM_DATABASE_URL": url,
        "AGL_STREAM_BOOTSTRAP_SERVERS": backend.bootstrap_servers,
    }
    text = said(await invoke(["status"], env), 1)
    assert f'database "nodb_{unique}" does not exist' in text
    assert "InvalidCatalogNameError" not in text
