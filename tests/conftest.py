"""Shared test configuration: tiers by directory, markers by tier, the chaos test's size and
its summary at the end of the run."""

from __future__ import annotations

from pathlib import Path

import pytest

INTEGRATION = Path(__file__).parent / "integration"
_CHAOS_SUMMARIES: list[str] = []


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
