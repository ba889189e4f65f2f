"""Shared test configuration: tiers by directory, markers by tier, the chaos test's size and
its summary at the end of the run."""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

INTEGRATION = Path(__file__).parent / "integration"
_CHAOS_SUMMARIES: list[str] = []


def _parse_again_after_a_race(parse: Callable[..., Any]) -> Callable[..., Any]:
    """ast.parse, tried again when CPython 3.11's AST constructor reports a recursion depth
    mismatch: its depth counter is shared by threads (python/cpython#106905), so a parse
    that meets another thread's (traceback.format_exception parses each failing line's
    segment in 3.11) fails spuriously. pytest parses the test's source to report a failure,
    and that SystemError turned a failing test into an INTERNALERROR that stopped the run
    and hid the failure."""

    @functools.wraps(parse)
    def parse_(*args: Any, **kwargs: Any) -> Any:
        for attempt in range(10):
            try:
                return parse(*args, **kwargs)
            except SystemError as exc:
                if "recursion depth mismatch" not in str(exc) or attempt == 9:
                    raise
        raise AssertionError("unreachable")

    return parse_


ast.parse = _parse_again_after_a_race(ast.parse)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--chaos-size",
        choices=("ci", "long"),
        default="ci",
        help="How much the chaos test runs: ci (a few hundred rollouts, the default) or long "
        "(thousands, for manual runs: make chaos).",
    )
    parser.addoption(
        "--multi-host-size",
        choices=("ci", "long"),
        default="ci",
        help="How much the multi-host test runs: ci (one cut of a runner host and one of a "
        "broker host, the default) or long (several of each: make multi-host).",
    )
    parser.addoption(
        "--record-fuzz-size",
        choices=("ci", "long"),
        default="ci",
        help="How many generated records the record fuzz test sends: ci (1,500, the default) "
        "or long (20,000: make fuzz).",
    )
    parser.addoption(
        "--store-kill-size",
        choices=("ci", "long"),
        default="ci",
        help="How many times the store kill test kills `agl-stream store` under load: ci (4, "
        "the default) or long (50: make store-kill).",
    )
    parser.addoption(
        "--faults-size",
        choices=("ci", "long"),
        default="ci",
        help="How hard the fault tests push: ci (PostgreSQL killed twice and down 10 s, "
        "the default) or long (killed 10 times and down 2 minutes: make faults).",
    )
    parser.addoption(
        "--store-kill-seed",
        type=int,
        default=1,
        help="The seed of the store kill test's kill moments and load (default 1).",
    )
    parser.addoption(
        "--real-model-adapter",
        action="store_true",
        help="Also serve the real model's versions as vLLM LoRA adapters in its test (about "
        "90 s more: make test-real-model).",
    )
    parser.addoption(
        "--vllm-demo",
        action="store_true",
        help="Also run the demo with the vLLM engine (minutes; make test-vllm-demo).",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if INTEGRATION in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture
def chaos_size(request: pytest.FixtureRequest) -> str:
    return str(request.config.getoption("--chaos-size"))


@pytest.fixture
def chaos_summaries() -> list[str]:
    return _CHAOS_SUMMARIES


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for summary in _CHAOS_SUMMARIES:
        terminalreporter.write_sep("=", "chaos summary")
        terminalreporter.write_line(summary)
