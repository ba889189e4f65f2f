"""Mistakes a person makes on the command line stop the command with a sentence that names
what to change, never a traceback (issue 31). These need no broker or database: nothing
listens at the addresses given, or the mistake is caught before either is used. Those that
need a real database are in tests/integration/cli/test_cli_mistakes.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from agl_stream.cli.main import cli
from agl_stream.commands.enqueue import MAX_INPUT_BYTES
from agl_stream.embedded.process import pick_port

NOBODY = {
    "AGL_STREAM_BOOTSTRAP_SERVERS": f"127.0.0.1:{pick_port(40_000, 50_000)}",
    "AGL_STREAM_DATABASE_URL": f"postgresql://agl:s3cret@127.0.0.1:{pick_port(50_000, 60_000)}/x",
    "AGL_STREAM_REQUEST_TIMEOUT_MS": "1000",
}


def said(result: Result, code: int) -> str:
    """The command's output on one line, once it has exited with `code` on its own (an
    exception CliRunner caught would be a traceback for a person)."""
    assert isinstance(result.exception, SystemExit), (result.exception, result.output)
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return " ".join(result.output.split())


@pytest.mark.parametrize(
    "args",
    [
        ["query", "rollouts", "--since"],
        ["query", "rollouts", "--until"],
        ["query", "spans", "ro-1", "--since"],
        ["query", "rewards", "ro-1", "--until"],
        ["cancel", "--since"],
        ["export", "--since"],
        ["replay", "--until-time"],
        ["retrain", "--from-time"],
        ["reward", "ro-1", "1", "--given-at"],
    ],
    ids=" ".join,
)
@pytest.mark.parametrize(
    ("time", "problem"),
    [
        ("99999999d", "'99999999d' is too long ago"),
        ("9" * 400 + "d", "'9999999999999999999999999999999999999999...' is too long ago"),
        ("0001-01-01T00:00:00+01:00", "is out of range"),
    ],
    ids=["age", "huge age", "before year 1 in UTC"],
)
def test_a_time_out_of_range_is_a_sentence(args: list[str], time: str, problem: str) -> None:
    text = said(CliRunner().invoke(cli, [*args, time], env=NOBODY), 2)
    assert args[-1] in text and problem in text


def test_a_reward_given_in_the_far_future_is_refused() -> None:
    result = CliRunner().invoke(
        cli, ["reward", "ro-1", "1", "--given-at", "9999-12-31T23:59:59Z"], env=NOBODY
    )
    assert "given_at 9999-12-31T23:59:59+00:00 is in the future" in said(result, 2)


@pytest.mark.parametrize(
    "args",
    [["db", "current"], ["db", "upgrade"], ["query", "rollouts"], ["query", "read-models"],
     ["cancel", "ro-1"], ["requeue", "ro-1"], ["status"], ["export"]],
    ids=" ".join,
)  # fmt: skip
@pytest.mark.parametrize("port", ["99999", "0x10", "65536"])
def test_a_database_port_that_is_no_port_names_the_setting(args: list[str], port: str) -> None:
    url = f"postgresql://agl:s3cret@127.0.0.1:{port}/agl_stream"
    result = CliRunner().invoke(cli, args, env={**NOBODY, "AGL_STREAM_DATABASE_URL": url})
    text = said(result, 2)
    assert "--database-url / AGL_STREAM_DATABASE_URL" in text
    assert f"port '{port}' is not a port number" in text
    assert "s3cret" not in text


@pytest.mark.parametrize(
    "args",
    [["db", "current"], ["db", "upgrade"], ["query", "rollouts"], ["query", "read-models"],
     ["query", "lag"], ["requeue", "ro-1"], ["replay"], ["export"]],
    ids=" ".join,
)  # fmt: skip
def test_an_unreachable_database_names_the_setting(args: list[str]) -> None:
    text = said(CliRunner().invoke(cli, args, env=NOBODY), 1)
    shown = NOBODY["AGL_STREAM_DATABASE_URL"].replace(":s3cret@", ":***@")
    assert f"AGL_STREAM_DATABASE_URL ({shown}): cannot reach PostgreSQL" in text
    assert "s3cret" not in text


def test_the_database_flag_is_named_when_it_gave_the_url() -> None:
    url = NOBODY["AGL_STREAM_DATABASE_URL"].replace("s3cret", "other")
    text = said(CliRunner().invoke(cli, ["--database-url", url, "db", "current"], env=NOBODY), 1)
    assert f"--database-url ({url.replace(':other@', ':***@')}): cannot reach" in text


@pytest.mark.parametrize(
    "args",
    [["enqueue"], ["reward", "ro-1", "1"], ["cancel", "--force", "ro-1"], ["dlq", "list"],
     ["topics", "apply"]],
    ids=" ".join,
)  # fmt: skip
def test_an_unreachable_broker_is_one_sentence(args: list[str]) -> None:
    result = CliRunner().invoke(cli, args, env=NOBODY, input='{"q": 1}\n')
    assert "cannot reach the Kafka brokers" in said(result, 1)


@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_enqueue_key_is_refused(key: str) -> None:
    result = CliRunner().invoke(cli, ["enqueue", "--key", key], env=NOBODY, input='{"q": 1}\n')
    assert "--key: an empty key names nothing" in said(result, 2)


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (json.dumps({"x": "y" * 10_000_000}), f"over the limit of {MAX_INPUT_BYTES:,}"),
        ('{"x": NaN}', "not JSON-serialisable"),
        ("{oops", "not valid JSON"),
    ],
    ids=["10 MB", "NaN", "not JSON"],
)
def test_an_enqueue_files_bad_line_is_named_by_file_and_line(
    tmp_path: Path, line: str, problem: str
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(f'{{"q": 1}}\n\n{line}\n{{"q": 2}}\n')
    text = said(CliRunner().invoke(cli, ["enqueue", str(tasks)], env=NOBODY), 2)
    assert f"{tasks}:3: " in text and problem in text
    assert len(text) < 400  # the line itself is not echoed


def test_a_json_files_bad_item_is_named(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.json"
    tasks.write_text('[{"q": 1}, {"x": NaN}]')
    text = said(CliRunner().invoke(cli, ["enqueue", str(tasks)], env=NOBODY), 2)
    assert f"{tasks} item 2: task input is not JSON-serialisable" in text


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        ('raise RuntimeError("boom")\n', "RuntimeError: boom at {path}:1"),
        ("x = 1\ndef f(:\n    pass\n", "SyntaxError: invalid syntax ({name}.py, line 2)"),
        ("import os\nnowhere\n", "NameError: name 'nowhere' is not defined at {path}:2"),
    ],
    ids=["raises", "syntax", "name"],
)  # fmt: skip
def test_an_agent_module_that_fails_to_import_is_a_sentence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, problem: str
) -> None:
    name = f"agent_{tmp_path.name.replace('-', '_')}"
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", list(__import__("sys").path))  # load_agent adds the cwd
    result = CliRunner().invoke(cli, ["worker", "runner", "--agent", f"{name}:solve"], env=NOBODY)
    text = said(result, 2)
    assert f"--agent: cannot import agent module '{name}'" in text
    assert problem.format(path=path, name=name) in text


@pytest.mark.parametrize("name", ["", "a b", "x" * 65, "speaker/v1"])
def test_a_policy_name_that_cannot_name_a_resource_is_refused(tmp_path: Path, name: str) -> None:
    args = ["worker", "trainer", "--checkpoint-dir", str(tmp_path), "--policy", name]
    text = said(CliRunner().invoke(cli, args, env=NOBODY), 2)
    assert f"--policy {name!r}: a policy's name is 1-64 letters" in text


@pytest.mark.parametrize(
    "extra", [["--model", "smollm2-135m-instruct"], ["--engine", "vllm"], ["--max-staleness", "1"]]
)
def test_the_two_agent_demo_refuses_the_one_policy_demos_options(extra: list[str]) -> None:
    result = CliRunner().invoke(cli, ["demo", "--task", "two-agents", *extra], env=NOBODY)
    assert "--task two-agents runs two tiny models" in said(result, 2)


def test_a_policy_named_twice_is_refused(tmp_path: Path) -> None:
    args = ["worker", "trainer", "--checkpoint-dir", str(tmp_path)]
    text = said(CliRunner().invoke(cli, [*args, "--policy", "a", "--policy", "a"], env=NOBODY), 2)
    assert "--policy names a policy twice: a, a" in text


def test_an_agent_match_that_is_no_regular_expression_is_refused(tmp_path: Path) -> None:
    args = ["worker", "trainer", "--checkpoint-dir", str(tmp_path), "--agent-match", "write("]
    text = said(CliRunner().invoke(cli, args, env=NOBODY), 2)
    assert "--agent-match 'write(': missing ), unterminated subpattern" in text


def test_one_trainer_process_gives_each_policy_its_directory_seed_and_id(tmp_path: Path) -> None:
    from agl_stream.cli.train import each_policy, trainer_config
    from agl_stream.cli.worker import trainer

    args = ["--checkpoint-dir", f"{tmp_path}/", "--seed", "5", "--agent-match", "^write"]
    options = trainer.make_context(
        "trainer", [*args, "--policy", "speaker", "--policy", "listener"]
    ).params
    base = trainer_config(**options)
    found = each_policy(base, options["policies"])
    assert [(c.policy, c.checkpoint_dir, c.grpo.seed) for c in found] == [
        ("speaker", f"{tmp_path}/speaker", 5), ("listener", f"{tmp_path}/listener", 6),
    ]  # fmt: skip
    assert len({c.worker_id for c in found}) == 2
    assert {c.agent_match for c in found} == {"^write"}  # one match for every policy
    assert each_policy(base, ("speaker",)) == [base]


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--policy", "a", "--resource", "b"], "--resource and --policy do not mix"),
        (["--policy", "a", "--served-model-name", "b"], "--served-model-name and --policy"),
        (["--policy", "a", "--model", "tiny"], "--model and --policy do not mix"),
        (["--policy", "a b"], "--policy 'a b': a policy's name is 1-64 letters"),
        (["--policy", "a", "--policy", "a"], "--policy names a policy twice"),
        (
            ["--policy", "a", "--policy", "b", "--engine", "vllm", "--vllm-lora", "merge"],
            "--vllm-lora merge serves one policy",
        ),
    ],
    ids=["resource", "model name", "model", "bad name", "twice", "merge"],
)
def test_serving_several_policies_wrongly_is_a_sentence(args: list[str], problem: str) -> None:
    text = said(CliRunner().invoke(cli, ["serve", *args], env=NOBODY), 2)
    assert problem in text
