"""The CLI without a broker: help everywhere, and bad input exits non-zero with a sentence."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from agl_stream.cli.main import cli
from agl_stream.embedded.process import pick_port


def _commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [prefix]
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            out += _commands(command, (*prefix, name))
        else:
            out.append((*prefix, name))
    return out


@pytest.mark.parametrize("path", _commands(cli), ids=lambda p: " ".join(p) or "agl-stream")
def test_every_command_explains_itself(path: tuple[str, ...]) -> None:
    result = CliRunner().invoke(cli, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output
    lines = result.output.split("\n\n")
    assert len(lines) > 1 and lines[1].strip(), "a command needs a description"


def test_bad_bootstrap_servers_is_a_usage_error() -> None:
    result = CliRunner().invoke(cli, ["--bootstrap-servers", "nohostport", "topics", "apply"])
    assert result.exit_code == 2
    assert "--bootstrap-servers / AGL_STREAM_BOOTSTRAP_SERVERS 'nohostport'" in result.output
    assert "Traceback" not in result.output


def test_bad_environment_is_a_usage_error() -> None:
    result = CliRunner().invoke(
        cli, ["topics", "apply"], env={"AGL_STREAM_SECURITY_PROTOCOL": "TLS"}
    )
    assert result.exit_code == 2
    assert "AGL_STREAM_SECURITY_PROTOCOL 'TLS'" in result.output


def test_unreachable_broker_is_one_sentence() -> None:
    port = pick_port(40_000, 50_000)  # nothing listens there
    result = CliRunner().invoke(
        cli, ["--bootstrap-servers", f"127.0.0.1:{port}", "topics", "apply"],
        env={"AGL_STREAM_REQUEST_TIMEOUT_MS": "2000"},
    )  # fmt: skip
    assert result.exit_code == 1
    assert "cannot reach the Kafka brokers" in result.output
    assert "Traceback" not in result.output


def test_status_reports_unreachable_services_and_fails() -> None:
    broker, database = pick_port(40_000, 50_000), pick_port(50_000, 60_000)
    result = CliRunner().invoke(
        cli, ["--bootstrap-servers", f"127.0.0.1:{broker}",
              "--database-url", f"postgresql://agl:pw@127.0.0.1:{database}/agl_stream", "status"],
    )  # fmt: skip
    assert result.exit_code == 1
    assert "unreachable" in result.output
    assert "pw@" not in result.output


def test_unknown_event_schema_is_a_bad_parameter() -> None:
    result = CliRunner().invoke(cli, ["schemas", "show", "NoSuchEvent"])
    assert result.exit_code == 2
    assert "no event 'NoSuchEvent'" in result.output


def test_schema_show_prints_an_expanded_schema() -> None:
    result = CliRunner().invoke(cli, ["schemas", "show", "AttemptFinished"])
    assert result.exit_code == 0
    assert '"ai.aglstream.ErrorInfo"' in result.output  # named types are inlined


def test_schemas_check_passes() -> None:
    result = CliRunner().invoke(cli, ["schemas", "check"])
    assert result.exit_code == 0, result.output
    assert "compatible with release" in result.output


def test_unknown_topic_name_in_check() -> None:
    result = CliRunner().invoke(cli, ["topics", "check", "nope"])
    assert result.exit_code == 2
    assert "unknown topics ['nope']" in result.output


def test_a_trainer_without_a_checkpoint_dir_is_told_so() -> None:
    result = CliRunner().invoke(cli, ["worker", "trainer"])
    assert result.exit_code == 2
    assert "a trainer needs --checkpoint-dir" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "a runner needs the agent to run: --agent MODULE:ATTR or --agent-command"),
        (["--agent", "tests.support.agents:behave", "--agent-command", "true"], "not both"),
        (["--agent-command", "true", "--no-gateway"], "--agent-command needs the runner's gateway"),
        (["--agent-command", "node 'agent.js"], "cannot split the command"),
        (["--agent-command", "  "], "a process agent needs a command to run"),
        (["--agent", "no_colon"], "must look like package.module:attribute"),
    ],
)
def test_a_runner_without_a_usable_agent_is_told_why(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["worker", "runner", *args], env={})
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output


def test_a_bad_trainer_setting_is_a_usage_error() -> None:
    for args, message in [
        (["--learning-rate", "0"], "--learning-rate"),
        (["--group-size", "0"], "--group-size"),
        (["--reward-rule", "best"], "--reward-rule"),
        (["--checkpoint-dir", "gs://bucket/x"], "local paths, file:// and s3:// URIs"),
    ]:
        result = CliRunner().invoke(cli, ["worker", "trainer", *args])
        assert result.exit_code != 0, args
        assert message in result.output, (args, result.output)
        assert "Traceback" not in result.output


def test_retrain_offsets_are_checked() -> None:
    result = CliRunner().invoke(
        cli, ["retrain", "--checkpoint-dir", "x", "--from-offset", "spans:99=1"]
    )
    assert result.exit_code == 2 and "spans has partitions 0-7, not 99" in result.output
    result = CliRunner().invoke(
        cli, ["retrain", "--checkpoint-dir", "x", "--until-offset", "workers:0=1"]
    )
    assert result.exit_code == 2 and "a trainer reads tasks, rollouts and spans" in result.output
    result = CliRunner().invoke(
        cli, ["retrain", "--checkpoint-dir", "x", "--from-offset", "spans=1"]
    )
    assert result.exit_code == 2 and "write TOPIC:PARTITION=OFFSET" in result.output
    result = CliRunner().invoke(cli, ["retrain", "--checkpoint-dir", "x", "--max-staleness", "1"])
    assert result.exit_code == 2 and "--max-staleness does not apply to retrain" in result.output


def test_checkpoints_of_an_empty_directory(tmp_path: object) -> None:
    result = CliRunner().invoke(cli, ["checkpoints", "--checkpoint-dir", str(tmp_path)])
    assert result.exit_code == 2 and "no checkpoints in" in result.output


def test_checkpoints_of_one_policy_of_several(tmp_path: Path) -> None:
    """One trainer process of two policies keeps DIR/<policy>: `checkpoints` asks which,
    `--policy` reads it, and a directory of another policy's is refused."""
    from agl_stream.training.checkpoints import CheckpointStore

    for policy in ("speaker", "listener"):
        state = {"step": 1, "version": 1, "resources_id": f"g-{policy}-v1", "policy": policy,
                 "consumed": {"spans:0": [0, 8]}, "cut": {"spans:0": 8},
                 "attempts": [f"{policy}-a"]}  # fmt: skip
        CheckpointStore(str(tmp_path / policy)).write(1, lambda d: None, state)
    result = CliRunner().invoke(cli, ["checkpoints", "--checkpoint-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "several policies (listener, speaker): name one with --policy" in result.output
    args = ["checkpoints", "--checkpoint-dir", str(tmp_path), "--policy", "speaker"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "(policy speaker)" in text and "g-speaker-v1" in text and "g-listener" not in text
    assert "lineage: every consumed offset range once" in text
    args = ["checkpoints", "--checkpoint-dir", str(tmp_path / "listener"), "--policy", "speaker"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2
    assert "holds the checkpoints of policy listener, not 'speaker'" in result.output


def test_gateway_needs_an_http_upstream() -> None:
    result = CliRunner().invoke(cli, ["gateway", "--upstream", "localhost:8000"])
    assert result.exit_code == 2
    assert "'localhost:8000' is not an http(s) URL" in result.output


def test_serve_refuses_a_directory_that_is_no_model(tmp_path: object) -> None:
    result = CliRunner().invoke(cli, ["serve", "--model", str(tmp_path), "--port", "0"])
    assert result.exit_code == 2
    assert "is not a model checkpoint (no config.json)" in result.output


def test_serve_says_when_its_port_is_taken() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = CliRunner().invoke(cli, ["serve", "--model", "tiny", "--port", str(port)])
    assert result.exit_code == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.output


def test_status_leaves_out_the_groups_that_only_mark_an_enqueue() -> None:
    from agl_stream.commands.status import is_enqueue_marker

    assert is_enqueue_marker("agl.enqueue-0123456789abcdef")
    assert not is_enqueue_marker("agl-runners")
    assert not is_enqueue_marker("team-enqueue-workers")


def test_agent_lightning_roles_pick_the_worker() -> None:
    """AGL_CURRENT_ROLE as Agent Lightning users set it: `algorithm` is the trainer."""
    result = CliRunner().invoke(cli, ["worker"], env={"AGL_CURRENT_ROLE": "algorithm"})
    assert result.exit_code == 2
    assert "a trainer needs --checkpoint-dir" in result.output
    result = CliRunner().invoke(cli, ["worker"], env={"AGL_CURRENT_ROLE": "runner"})
    assert result.exit_code == 2
    assert "a runner needs the agent to run" in " ".join(result.output.split())


def test_serve_refuses_vllm_arguments_it_cannot_split() -> None:
    result = CliRunner().invoke(cli, ["serve", "--engine", "vllm", "--vllm-args", '"unclosed'])
    assert result.exit_code == 2
    assert "Invalid value for --vllm-args: cannot split" in result.output


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_serve_names_a_model_vllm_cannot_serve(tmp_path: Path) -> None:
    """A head size vLLM's CPU kernels refuse is a bad --model, said before vLLM starts."""
    from agl_stream.training.model import initial_policy, save_policy

    save_policy(initial_policy("tiny", 0), tmp_path / "tiny")
    result = CliRunner().invoke(
        cli, ["serve", "--engine", "vllm", "--model", str(tmp_path / "tiny")]
    )
    assert result.exit_code == 2
    assert "attention heads of size 16; vLLM's CPU kernels take only 32" in result.output
