"""What every benchmark starts with: the embedded stack (started if it is not running) and a
fresh set of topics of its own, so runs never read each other's records."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
from collections.abc import Callable, Coroutine, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from rich.table import Table

from agl_stream.bus.topic_admin import apply_topics
from agl_stream.embedded.process import pick_ports
from agl_stream.embedded.stack import EmbeddedStack, StackState
from agl_stream.runtime.config import KafkaSettings, StackSettings, load

F = TypeVar("F")


async def fresh_topics(
    prefix: str, state: StackState | None = None
) -> tuple[StackState, KafkaSettings]:
    """The stack (the one given, else the running one, started if need be) and Kafka
    settings for topics named `<prefix>.*`, created."""
    if state is None:
        stack = EmbeddedStack(load(StackSettings))
        state = stack.running() or stack.up()
    kafka = load(
        KafkaSettings, bootstrap_servers=state.bootstrap_servers, topic_prefix=f"{prefix}."
    )
    await apply_topics(kafka)
    return state, kafka


@contextmanager
def private_stack() -> Iterator[StackState]:
    """A stack of the benchmark's own, in a temporary home on free ports, stopped and removed
    afterwards: its processes (and their CPU time) serve this benchmark alone."""
    home = Path(tempfile.mkdtemp(prefix="agl-bench-stack-"))
    home.chmod(0o701)  # PostgreSQL runs as another user when we are root: let it walk in
    broker_port, postgres_port = pick_ports(2, 32_700, 33_400)  # the tests pick below 32,700
    stack = EmbeddedStack(
        StackSettings(home=home, broker_port=broker_port, postgres_port=postgres_port)
    )
    try:
        yield stack.up()
    finally:
        stack.down()
        shutil.rmtree(home, ignore_errors=True)


def benchmark_parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's command line, its module docstring as the help text."""
    return argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def run_benchmark(
    parser: argparse.ArgumentParser,
    main: Callable[[argparse.Namespace], Coroutine[Any, Any, F]],
    report: Callable[[F], None],
) -> F:
    """What every benchmark's command line does: parse, run, show the figures, print them
    as one JSON line, and write them to --json-out when asked (benchmarks.report reads them
    there)."""
    parser.add_argument("--json-out", type=Path, help="also write the figures to this file")
    arguments = parser.parse_args()
    figures: F = asyncio.run(main(arguments))
    if arguments.json_out:  # first: a report that fails loses no figures
        arguments.json_out.write_text(json.dumps(figures, indent=2))
    report(figures)
    print(json.dumps(figures))  # one line for scripts to read
    return figures


def key_value_table(title: str, figures: Mapping[str, object]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False)
    for key, value in figures.items():
        table.add_row(key, str(value))
    return table
