"""What every command shares: settings from flags and environment, and errors a person reads."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, ParamSpec, TypeVar

import asyncpg
import click
from aiokafka.errors import KafkaConnectionError, KafkaError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from sqlalchemy.exc import DBAPIError

from agl_stream.bus.kafka import KafkaCredentialsRefused
from agl_stream.bus.registry_client import RegistryError
from agl_stream.bus.topic_admin import TopicsNotReady
from agl_stream.bus.topic_spec import TopicSpecError, load_topic_specs
from agl_stream.db.problems import database_problem
from agl_stream.embedded.process import StackError
from agl_stream.queries.params import NotFound, QueryError
from agl_stream.runtime.auth import AuthSettings
from agl_stream.runtime.config import ConfigError, DatabaseSettings, KafkaSettings, load
from agl_stream.runtime.supervision import stop_on_signals as stop_on_signals  # its home
from agl_stream.telemetry.metrics import MetricsError

console = Console()


def training_progress(fields: str) -> Progress:
    """The demos' bar: steps done of all, then `fields` (a rich format of the task's fields,
    such as "mean reward {task.fields[reward]}"), then the time so far."""
    return Progress(
        TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TextColumn(fields),
        TimeElapsedColumn(), console=console,
    )  # fmt: skip


err_console = Console(stderr=True)

P = ParamSpec("P")
R = TypeVar("R")


@dataclass
class AppContext:
    bootstrap_servers: str | None
    topic_prefix: str | None
    database_url: str | None
    database_used: DatabaseSettings | None = None  # what database() gave, for error messages

    def kafka(self) -> KafkaSettings:
        return load(
            KafkaSettings, bootstrap_servers=self.bootstrap_servers, topic_prefix=self.topic_prefix
        )

    def database(self) -> DatabaseSettings:
        self.database_used = load(DatabaseSettings, database_url=self.database_url)
        return self.database_used

    def database_setting(self) -> str:
        """The setting that gave the database URL, and the URL without its password."""
        url = (self.database_used or self.database()).display_url()
        if self.database_url is not None:
            return f"--database-url ({url})"
        if os.environ.get("AGL_STREAM_DATABASE_URL") is not None:
            return f"AGL_STREAM_DATABASE_URL ({url})"
        return f"AGL_STREAM_DATABASE_URL (not set: the default, {url})"

    def auth(self) -> AuthSettings:
        """The bearer tokens (environment only: a flag would show them in `ps`)."""
        return load(AuthSettings)


class PathType(click.Path):
    """click.Path that refuses a NUL character with a sentence (os.stat would raise)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if "\x00" in str(value):
            self.fail("a path cannot contain a NUL character", param, ctx)
        return super().convert(value, param, ctx)


def torch_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--device, --dtype and --threads: where torch runs a model (AGL_STREAM_DEVICE,
    AGL_STREAM_DTYPE, AGL_STREAM_THREADS when not given; checked at start)."""
    options = [
        click.option("--device", metavar="auto|cpu|cuda[:N]",
                     help="Where torch runs the model; auto: a CUDA device if torch sees one. "
                          "[env: AGL_STREAM_DEVICE; default: auto]"),
        click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
                     help="The weights' precision; auto: bfloat16 on a GPU that has it, "
                          "float32 on the CPU. [env: AGL_STREAM_DTYPE; default: auto]"),
        click.option("--threads", type=click.IntRange(1),
                     help="torch's intra-op threads. [env: AGL_STREAM_THREADS; default: "
                          "1 for a trainer, torch's own for the policy server]"),
    ]  # fmt: skip
    for option in reversed(options):
        func = option(func)
    return func


def friendly_errors(func: Callable[P, R]) -> Callable[P, R]:
    """Turn the errors we expect into one sentence and a non-zero exit, never a traceback."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from None
        except NotFound as exc:
            fail(str(exc))
        except QueryError as exc:
            fail(f"bad query: {exc}", code=2)
        except TimeoutError as exc:
            fail(database_error(exc) or str(exc) or "timed out")
        except (StackError, TopicsNotReady, TopicSpecError, MetricsError, RegistryError) as exc:
            fail(str(exc))
        except KafkaCredentialsRefused as exc:
            fail(str(exc))
        except KafkaConnectionError as exc:
            fail(f"cannot reach the Kafka brokers ({exc}); is the stack up (`agl-stream up`)?")
        except KafkaError as exc:
            fail(f"the broker refused: {exc}")
        except (OSError, asyncpg.PostgresError, DBAPIError) as exc:
            fail(database_error(exc) or f"{exc}")

    return wrapper


def database_error(exc: BaseException) -> str | None:
    """A database error as a sentence that names the setting to change (the URL without its
    password); None for an error that did not come from PostgreSQL."""
    problem = database_problem(exc)
    if problem is None:
        return None
    ctx = click.get_current_context(silent=True)
    app = ctx.find_object(AppContext) if ctx is not None else None
    if app is None or app.database_used is None:  # not the configured database (`up`'s own)
        return problem
    return f"{app.database_setting()}: {problem}"


@contextmanager
def _socket_errors(doing: str) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        fail(f"{doing}: {exc.strerror or exc}")


def listening_on(address: str) -> contextlib.AbstractContextManager[None]:
    """Say which address a server could not take (in use, not this machine's)."""
    return _socket_errors(f"cannot listen on {address}")


def fail(message: str, code: int = 1) -> NoReturn:
    """Say what went wrong in one sentence on stderr and exit with `code`."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise SystemExit(code)


def run(coro: Coroutine[Any, Any, R]) -> R:
    return asyncio.run(coro)


def parse_key_values(values: tuple[str, ...], flag: str) -> dict[str, str]:
    """KEY=VALUE options (repeatable) as a dict; a bad one is a usage error naming it."""
    out = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint=flag)
        out[key] = value
    return out


def metadata_filter(values: tuple[str, ...], flag: str = "--metadata") -> dict[str, str | None]:
    """KEY=VALUE (the key has this value) or KEY (the key is present) filter options."""
    out: dict[str, str | None] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not key:
            raise click.BadParameter(f"{item!r}: give KEY=VALUE or KEY", param_hint=flag)
        out[key] = value if sep else None
    return out


def text_or_file(value: str, flag: str) -> str:
    """An option's text as given, or a file's when it is @PATH."""
    if not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # ValueError: a NUL in the path
        raise click.BadParameter(f"cannot read {value[1:]}: {exc}", param_hint=flag) from None


_OFFSET = re.compile(r"^([A-Za-z0-9._-]+):(\d+)=(\d+)$")


def parse_offsets(
    values: tuple[str, ...], flag: str, prefix: str, topics: Sequence[str], who: str
) -> dict[tuple[str, int], int]:
    """TOPIC:PARTITION=OFFSET options, keyed by (short topic name, partition). A topic may
    be named with or without the prefix; only `topics` (what `who` reads) are accepted."""
    specs = load_topic_specs()
    out: dict[tuple[str, int], int] = {}
    for value in values:
        match = _OFFSET.match(value)
        if not match:
            raise click.BadParameter(
                f"{value!r}: write TOPIC:PARTITION=OFFSET, for example spans:3=1200",
                param_hint=flag,
            )
        topic, partition = match.group(1).removeprefix(prefix), int(match.group(2))
        if topic not in topics:
            raise click.BadParameter(
                f"no topic {match.group(1)!r} here: {who} reads "
                f"{', '.join(topics[:-1])} and {topics[-1]}",
                param_hint=flag,
            )
        if partition >= specs[topic].partitions:
            raise click.BadParameter(
                f"{topic} has partitions 0-{specs[topic].partitions - 1}, not {partition}",
                param_hint=flag,
            )
        out[(topic, partition)] = int(match.group(3))
    return out


def read_model_option(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """--read-model NAME: which read model a command reads (default: the active one); `what`
    says what the command does with it."""
    return click.option(
        "--read-model",
        metavar="NAME",
        help=f"{what} this read model instead of the active one (see `query read-models`).",
    )


POLICY_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_policies(policies: Sequence[str]) -> list[str]:
    """--policy's names (repeated): each 1-64 of [A-Za-z0-9_-], none twice."""
    for policy in policies:
        if not POLICY_NAME.fullmatch(policy):
            raise click.UsageError(
                f"--policy {policy!r}: a policy's name is 1-64 letters, digits, '_' or '-' "
                "(it is a resource's name and part of ids and a consumer group)"
            )
    if len(set(policies)) < len(policies):
        raise click.UsageError(f"--policy names a policy twice: {', '.join(policies)}")
    return list(policies)
