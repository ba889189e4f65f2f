"""Fuzzing every input boundary that needs no broker: the CLI (random flags and values, bad
files, bad environment), the configuration, the enqueue API (any JSON, oversized inputs,
invalid options, any file bytes), the query parameters and cursors, dead-letter headers.
Each input is either accepted or refused with the library's own error and a sentence;
nothing else escapes. What is accepted is checked against what was given: a setting holds
the value of its variable, a task file yields the tasks written in it, a parsed command
line holds the options it named and defaults for the rest. (The codec's fuzzing is in
test_codec.py; malformed records against running workers in the chaos test.)"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import string
from collections.abc import Iterator
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import click
import pytest
from click.core import ParameterSource
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, SecretStr

from agl_stream.bus import kafka
from agl_stream.bus.codec import Codec
from agl_stream.bus.dead_letters import DeadLetterView
from agl_stream.cli.main import cli
from agl_stream.commands.enqueue import EnqueueError, RolloutOptions, make_rollout, read_tasks
from agl_stream.embedded.process import pick_port
from agl_stream.events import AttemptStatus, RolloutMode
from agl_stream.queries.params import QueryError, RolloutFilter, decode_cursor
from agl_stream.runtime.config import ENV_PREFIX, ConfigError, DatabaseSettings, KafkaSettings, load
from tests.unit.cli.test_cli import _commands

# Commands that would start something long-lived when their input happens to be valid:
# only their parsing is fuzzed. The others run to the end against nothing listening.
# Parsed only, never run: long-lived commands (a valid line would start a server or a
# worker), and `schemas release`, which writes into the repository's schemas/released/.
LONG_LIVED = {"up", "down", "demo", "worker", "serve", "gateway", "chaos", "release", "ingest"}

NOBODY = pick_port(40_000, 50_000)
UNREACHABLE_ENV = {
    "AGL_STREAM_BOOTSTRAP_SERVERS": f"127.0.0.1:{NOBODY}",
    "AGL_STREAM_DATABASE_URL": f"postgresql://agl@127.0.0.1:{pick_port(50_000, 60_000)}/x",
    "AGL_STREAM_REQUEST_TIMEOUT_MS": "1000",
    "AGL_STREAM_HOME": "/nonexistent/agl-stream-fuzz",
}


@pytest.fixture(scope="module", autouse=True)
def _brief_broker_retries() -> Iterator[None]:
    """Commands that reach for the (absent) broker give up after 2 s, not after the 60 s a
    command keeps retrying while a cluster's node is down: what is checked is the sentence,
    and one such example took a minute of CI."""
    with pytest.MonkeyPatch.context() as patch:
        defaults = kafka.retrying.__defaults__ or ()
        patch.setattr(kafka.retrying, "__defaults__", (2.0, *defaults[1:]))
        yield


def _command(path: tuple[str, ...]) -> click.Command:
    command: click.Command = cli
    for name in path:
        assert isinstance(command, click.Group)
        command = command.commands[name]
    return command


def _leaves(group: click.Group) -> list[tuple[str, ...]]:
    """Every command that runs (not a group), as test_cli lists them."""
    return [p for p in _commands(group) if not isinstance(_command(p), click.Group)]


def _option_names(command: click.Command) -> list[str]:
    return [n for p in command.params if isinstance(p, click.Option) for n in p.opts]


TEXT = st.text(alphabet=string.printable + "é✓\x00", max_size=30)
VALUES = st.one_of(
    TEXT,
    st.integers(-(10**12), 10**12).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(["", "-", "--", "0", "-1", "nan", "1e309", "a:b", "x=y", "=", "/", "..",
                     "topic:0=5", "2026-13-45", "ro-1", "--help"]),
)  # fmt: skip


@st.composite
def invocations(draw: st.DrawFn, paths: list[tuple[str, ...]]) -> list[str]:
    path = draw(st.sampled_from(paths))
    names = _option_names(_command(path)) + _option_names(cli)
    tokens = draw(st.lists(st.one_of(st.sampled_from(names), VALUES), max_size=8))
    return [*path, *tokens]


def assert_sentence(message: str) -> None:
    assert message.strip() and "Traceback" not in message, message


def _check_cli(args: list[str], tmp: Path) -> None:
    # In a folder of its own: generated arguments name output files (`export -o 0`), which
    # were written into the checkout.
    with contextlib.chdir(tmp):
        result = CliRunner().invoke(cli, args, env={**UNREACHABLE_ENV, "HOME": str(tmp)})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"agl-stream {args} raised {result.exception!r}") from (
            result.exception
        )
    assert result.exit_code in (0, 1, 2), (args, result.exit_code, result.output)
    assert "Traceback" not in result.output, (args, result.output)
    if result.exit_code != 0:
        assert result.output.strip(), f"agl-stream {args} failed without a word"


SHORT = [p for p in _leaves(cli) if p[0] not in LONG_LIVED and p[-1] not in LONG_LIVED]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(args=invocations(SHORT))
def test_cli_commands_answer_any_arguments_with_a_sentence(
    args: list[str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    _check_cli(args, tmp_path_factory.mktemp("home"))


LONG = [p for p in _leaves(cli) if p[0] in LONG_LIVED or p[-1] in LONG_LIVED]


@st.composite
def leaf_invocations(draw: st.DrawFn, paths: list[tuple[str, ...]]) -> tuple[str, list[str]]:
    path = draw(st.sampled_from(paths))
    names = _option_names(_command(path))
    return path, draw(st.lists(st.one_of(st.sampled_from(names), VALUES), max_size=8))


@settings(max_examples=150, deadline=None)
@given(invocation=leaf_invocations(LONG))
@example(invocation=(("demo",), ["--seed", "3", "--steps", "2", "--keep-stack"]))
@example(invocation=(("serve",), ["-v", "--port", "8001", "--pin", "--port"]))
@example(invocation=(("worker", "runner"), ["--concurrency", "4", "--heartbeat", "0.5"]))
def test_long_lived_commands_parse_any_arguments_or_say_why(
    invocation: tuple[tuple[str, ...], list[str]],
) -> None:
    """Parsing only: a valid command line would start a server or a worker, or write a
    schema release into the repository."""
    path, tokens = invocation
    command = _command(path)
    try:
        ctx = command.make_context(path[-1], list(tokens))  # click consumes the list it gets
    except click.exceptions.Exit:
        return
    except click.ClickException as exc:
        assert_sentence(exc.format_message())
        return
    with ctx:
        assert_read_as_given(command, ctx, tokens)


def assert_read_as_given(command: click.Command, ctx: click.Context, tokens: list[str]) -> None:
    """Every value is there; one taken from the command line was given there (its flag is
    among the tokens), and one that was not holds what it holds with no arguments at all."""
    try:
        with command.make_context(ctx.info_name, []) as bare:
            defaults = dict(bare.params)
    except click.ClickException:  # a required argument: no line without arguments parses
        defaults = {}
    for param in command.params:
        if not param.expose_value or param.name is None:
            continue
        assert param.name in ctx.params, (param.name, tokens)
        source = ctx.get_parameter_source(param.name)
        if isinstance(param, click.Option) and source is ParameterSource.COMMANDLINE:
            flags = [*param.opts, *param.secondary_opts]
            assert any(t.startswith(f) for t in tokens for f in flags), (param.name, tokens)
        if source is ParameterSource.DEFAULT and param.name in defaults:
            assert ctx.params[param.name] == defaults[param.name], (param.name, tokens)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    suffix=st.sampled_from([".jsonl", ".json", ".parquet", ".csv", ""]),
    content=st.binary(max_size=300),
    flags=st.lists(st.sampled_from(["--format", "jsonl", "json", "parquet", "--max-attempts",
                                    "0", "--timeout", "-3", "--mode", "eval"]), max_size=3),
)  # fmt: skip
def test_enqueue_names_what_is_wrong_with_any_file(
    suffix: str, content: bytes, flags: list[str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    tmp = tmp_path_factory.mktemp("files")
    file = tmp / f"input{suffix}"
    file.write_bytes(content)
    _check_cli(["enqueue", str(file), *flags], tmp)


# ---- configuration --------------------------------------------------------------------------

SETTING_FIELDS = sorted(
    {(cls, name) for cls in (KafkaSettings, DatabaseSettings) for name in cls.model_fields},
    key=lambda x: (x[0].__name__, x[1]),
)


# Values some setting accepts, so that each is read back now and then.
SETTING_VALUES = ["SSL", "SASL_SSL", "PLAIN", "1500", "localhost:9092", " a:1 , b:2 ,", "p.",
                  "postgresql://agl:secret@db:5432/agl"]  # fmt: skip


def read_as(cls: type[BaseModel], name: str, value: str) -> Any:
    """What a setting holds once `value` was read from its variable: the text itself, but
    numbers as numbers, paths as paths, and the broker list without blanks."""
    if name == "bootstrap_servers":
        return ",".join(s.strip() for s in value.split(",") if s.strip())
    kind = cls.model_fields[name].annotation
    if kind is int:
        return Decimal(value)  # what int() takes, and "5.0" and "1_000" too, as pydantic does
    if kind == Path | None:
        return Path(value)
    return value


@settings(max_examples=300, deadline=None)
@given(
    field=st.sampled_from(SETTING_FIELDS),
    value=TEXT.filter(lambda v: "\x00" not in v)
    | st.integers(-5, 10**6).map(str)
    | st.sampled_from(SETTING_VALUES),
)
def test_any_environment_value_is_read_or_named(field: tuple[type, str], value: str) -> None:
    cls, name = field
    variable = f"{ENV_PREFIX}{name.upper()}"
    before = os.environ.get(variable)
    os.environ[variable] = value
    try:
        loaded = load(cls)
    except ConfigError as exc:
        message = str(exc)
        assert variable in message, message
        if "password" in name or name == "database_url":
            assert value not in message or len(value) < 3
        return
    finally:
        if before is None:
            del os.environ[variable]
        else:
            os.environ[variable] = before
    got = getattr(loaded, name)
    if isinstance(got, SecretStr):
        got = got.get_secret_value()
    assert got == read_as(cls, name, value), (variable, value, got)


# ---- the enqueue API -----------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=30,
)
OPTIONS = st.builds(
    RolloutOptions,
    mode=st.sampled_from(list(RolloutMode)),
    resources_id=st.none() | st.text(max_size=300),
    timeout_seconds=st.none() | st.floats(allow_nan=True),
    unresponsive_seconds=st.none() | st.floats(allow_nan=True),
    max_attempts=st.integers(-5, 10**6),
    retry_condition=st.lists(st.sampled_from(list(AttemptStatus)), max_size=4).map(tuple),
    metadata=st.dictionaries(st.text(max_size=20), st.text(max_size=200), max_size=5),
)


@settings(max_examples=300, deadline=None)
@given(task=JSON | st.text(min_size=0, max_size=5000), options=OPTIONS)
def test_any_task_and_options_make_a_valid_event_or_an_enqueue_error(
    task: Any, options: RolloutOptions
) -> None:
    try:
        event = make_rollout(task, options)
    except EnqueueError as exc:
        message = str(exc)
        assert_sentence(message)
        return
    # What is accepted is an event every consumer can read back.
    codec = Codec()
    assert codec.decode(codec.encode(event)) == event
    assert event.max_attempts >= 1
    for seconds in (event.timeout_seconds, event.unresponsive_seconds):
        assert seconds is None or (math.isfinite(seconds) and seconds > 0)


def test_oversized_inputs_of_every_shape_are_refused() -> None:
    for task in (
        "x" * 2_000_000,
        ["y" * 1000] * 2000,
        {str(i): i for i in range(200_000)},
    ):
        with pytest.raises(EnqueueError, match="over the limit"):
            make_rollout(task, RolloutOptions())


@st.composite
def task_files(draw: st.DrawFn) -> tuple[str, bytes]:
    """A file name suffix and bytes: random, or task inputs written as that format holds
    them (a JSON list, one JSON value a line), so that many files are accepted."""
    suffix = draw(st.sampled_from([".jsonl", ".json", ".parquet"]))
    tasks = st.lists(JSON, max_size=5)
    written = {
        ".jsonl": tasks.map(lambda ts: "".join(f"{json.dumps(t)}\n" for t in ts).encode()),
        ".json": tasks.map(lambda ts: json.dumps(ts).encode()),
    }
    content = st.binary(max_size=500) | JSON.map(lambda v: repr(v).encode())
    if suffix in written:
        content |= written[suffix]
    return suffix, draw(content)


def tasks_in(suffix: str, content: bytes) -> list[Any]:
    """The task inputs a file holds, read without read_tasks; ValueError if it holds none."""
    text = content.decode("utf-8")
    if suffix == ".json":
        tasks = json.loads(text)
        if not isinstance(tasks, list):
            raise ValueError("a JSON task file holds a list")
        return tasks
    if suffix == ".jsonl":
        return [json.loads(line) for line in re.split(r"\r\n|\r|\n", text) if line.strip()]
    raise ValueError("random bytes are not a Parquet file")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(file=task_files())
def test_any_file_bytes_are_read_as_written_or_refused_with_the_file_named(
    file: tuple[str, bytes], tmp_path_factory: pytest.TempPathFactory
) -> None:
    suffix, content = file
    path = tmp_path_factory.mktemp("tasks") / f"tasks{suffix}"
    path.write_bytes(content)
    try:
        expected: list[Any] | None = tasks_in(suffix, content)
    except ValueError:  # also UnicodeDecodeError and json's JSONDecodeError
        expected = None
    try:
        got: list[Any] | None = list(read_tasks(path))
    except EnqueueError as exc:
        got, refusal = None, str(exc)
    if got is None:
        assert path.name in refusal, refusal
        assert expected is None, f"{content!r} holds {expected!r}, but was refused: {refusal}"
        return
    assert expected is not None, f"{content!r} holds no tasks, but {got!r} were read"
    # Compared as JSON text: a NaN read back equals itself there.
    assert json.dumps(got) == json.dumps(expected)


# ---- query parameters ----------------------------------------------------------------------

FILTER_OPTIONS = st.dictionaries(
    st.sampled_from(["status", "mode", "since", "until", "time_field", "worker_id",
                     "resources_id", "metadata", "sort", "descending", "limit", "cursor",
                     "nonsense"]),
    st.one_of(
        JSON, st.datetimes(), st.datetimes(timezones=st.just(UTC)),
        st.lists(st.sampled_from(["succeeded", "failed", "queuing", "bogus", "train"])).map(tuple),
    ),
)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(options=FILTER_OPTIONS)
def test_any_rollout_filter_is_built_or_refused_with_a_query_error(
    options: dict[str, Any],
) -> None:
    try:
        made = RolloutFilter.of(**options)
    except QueryError as exc:
        message = str(exc)
        assert_sentence(message)
        return
    assert made.limit >= 1
    if made.since and made.until:
        assert made.since <= made.until


@settings(max_examples=400, deadline=None)
@given(
    cursor=st.text(max_size=80) | st.binary(max_size=80).map(lambda b: b.hex()),
    sort=st.sampled_from(["queued", "updated", "id"]),
    descending=st.booleans(),
)
def test_any_cursor_is_decoded_or_refused_with_a_query_error(
    cursor: str, sort: str, descending: bool
) -> None:
    try:
        value, rollout_id = decode_cursor(cursor, sort, descending)
    except QueryError as exc:
        message = str(exc)
        assert_sentence(message)
        return
    assert isinstance(rollout_id, str)
    assert sort == "id" or isinstance(value, datetime)


@settings(max_examples=300, deadline=None)
@given(
    headers=st.lists(
        st.tuples(
            st.sampled_from(["agl.dlq.reason", "agl.dlq.source.partition",
                             "agl.dlq.source.offset", "agl.dlq.kind", "other"]) | st.text(),
            st.binary(max_size=40),
        ),
        max_size=8,
    ),
    value=st.none() | st.binary(max_size=40),
)  # fmt: skip
def test_any_record_on_the_dead_letter_topic_can_be_listed(
    headers: list[tuple[str, bytes]], value: bytes | None
) -> None:
    view = DeadLetterView.parse(headers, value, 7)
    assert isinstance(view.source_partition, int) and isinstance(view.source_offset, int)
