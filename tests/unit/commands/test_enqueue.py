"""Reading task inputs and building rollouts: bad input is named, never half-queued."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from agl_stream.cli.main import cli
from agl_stream.commands.enqueue import (
    MAX_INPUT_BYTES,
    EnqueueError,
    RolloutOptions,
    enqueue,
    make_rollout,
    read_tasks,
)
from agl_stream.events import AttemptStatus
from agl_stream.runtime.config import KafkaSettings, load


def test_formats(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text('{"q": 1}\n\n{"q": 2}\n')
    (tmp_path / "t.json").write_text(json.dumps([{"q": 1}, 3]))
    assert list(read_tasks(tmp_path / "t.jsonl")) == [{"q": 1}, {"q": 2}]
    assert list(read_tasks(tmp_path / "t.json")) == [{"q": 1}, 3]
    assert list(read_tasks(None, stdin=io.StringIO('"a"\n"b"\n'))) == ["a", "b"]


def test_parquet(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is optional")
    import pyarrow as pa

    pq.write_table(pa.table({"q": [1, 2]}), tmp_path / "t.parquet")
    assert list(read_tasks(tmp_path / "t.parquet")) == [{"q": 1}, {"q": 2}]


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        ("bad.jsonl", '{"q": 1}\n{oops\n', "bad.jsonl:2: not valid JSON"),
        ("bad.json", '{"not": "a list"}', "must hold a list"),
        ("bad.txt", "x", "unknown file type '.txt'"),
    ],
)
def test_bad_files_are_named(tmp_path: Path, name: str, text: str, words: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(EnqueueError, match=words.replace("(", r"\(").replace(".", r"\.")):
        list(read_tasks(tmp_path / name))


def test_oversized_and_unserialisable_inputs() -> None:
    with pytest.raises(EnqueueError, match="over the limit"):
        make_rollout("x" * (MAX_INPUT_BYTES + 1), RolloutOptions())
    with pytest.raises(EnqueueError, match="not JSON-serialisable"):
        make_rollout({"x": object()}, RolloutOptions())


def test_invalid_options() -> None:
    with pytest.raises(EnqueueError, match="retry_condition"):
        make_rollout({}, RolloutOptions(max_attempts=2, retry_condition=(AttemptStatus.RUNNING,)))
    with pytest.raises(EnqueueError, match="timeout_seconds"):
        make_rollout({}, RolloutOptions(timeout_seconds=-1))


def test_cli_rejects_bad_input_before_touching_the_broker(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    runner = CliRunner()
    result = runner.invoke(cli, ["enqueue", str(tmp_path / "bad.jsonl")])
    assert result.exit_code == 2 and "bad.jsonl:1: not valid JSON" in result.output
    result = runner.invoke(cli, ["enqueue", str(tmp_path / "missing.jsonl")])
    assert result.exit_code == 2 and "no such file" in result.output
    result = runner.invoke(cli, ["enqueue", "--metadata", "novalue"], input='{"a": 1}\n')
    assert result.exit_code == 2 and "is not KEY=VALUE" in result.output
    result = runner.invoke(cli, ["enqueue"], input="")
    assert result.exit_code == 2 and "no task inputs" in result.output
    result = runner.invoke(cli, ["worker", "runner"])
    assert (
        result.exit_code == 2
        and "a runner needs the agent to run: --agent MODULE:ATTR" in result.output
    )
    result = runner.invoke(cli, ["worker", "runner", "--agent", "nope:x"])
    assert result.exit_code == 2 and "cannot import agent module 'nope'" in result.output


@pytest.mark.parametrize("timeout_ms", [0, -1, 2**31])
async def test_a_bad_transaction_timeout_is_named_before_touching_the_broker(
    timeout_ms: int,
) -> None:
    kafka = load(KafkaSettings, bootstrap_servers="127.0.0.1:9")  # nothing listens there
    with pytest.raises(EnqueueError, match=f"transaction_timeout_ms .* got {timeout_ms}"):
        await enqueue(kafka, [{"q": 1}], key="k", transaction_timeout_ms=timeout_ms)
