"""The worker roles as data (workers/*.toml): what `agl-stream worker` takes from them, and
the compose file and the Helm chart held to them."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
import yaml

from agl_stream.bus.roles import RoleSpecError, load_roles, role
from agl_stream.bus.topic_spec import load_topic_specs
from agl_stream.cli.main import cli
from agl_stream.projection.projector import projector_group
from agl_stream.runner.worker import runner_group
from agl_stream.training.trainer import trainer_group
from tests.support import ROOT


def test_each_role_is_defined_once_with_its_group_and_topics() -> None:
    roles = load_roles()
    assert sorted(roles) == ["projector", "runner", "trainer"]
    assert (runner_group("agl."), projector_group("agl."), trainer_group("agl.")) == (
        "agl-runners", "agl-projector", "agl-trainer",
    )  # fmt: skip
    assert runner_group("team.") == "team-runners"
    # A policy other than the default has a group of its own: its trainer's cut is its own.
    assert trainer_group("agl.", "speaker") == "agl-trainer-speaker"
    assert trainer_group("agl.", "policy") == "agl-trainer"
    partitions = {name: spec.partitions for name, spec in load_topic_specs().items()}
    assert role("runner").scaling.most(partitions) == partitions["tasks"]
    assert role("trainer").scaling.most(partitions) == 1


def test_a_bad_role_file_is_named_with_its_setting(tmp_path: Path) -> None:
    (tmp_path / "x.toml").write_text(
        'role = "x"\nsummary = "s"\ngroup = "x"\nconsumes = ["nope"]\nfollows = []\n'
        "produces = []\n[scaling]\nmin = 1\nmax = 1\n"
    )
    with pytest.raises(RoleSpecError, match=r"x\.toml: no topic is defined as nope"):
        load_roles.__wrapped__(tmp_path)
    (tmp_path / "x.toml").write_text('role = "x"\n')
    with pytest.raises(RoleSpecError, match=r"x\.toml: summary: Field required"):
        load_roles.__wrapped__(tmp_path)


def test_the_cli_takes_its_option_bounds_from_the_roles() -> None:
    worker = cli.commands["worker"]
    assert isinstance(worker, click.Group)
    for role_name, spec in load_roles().items():
        command = worker.commands[role_name]
        for option, (least, most) in spec.limits.items():
            (param,) = [p for p in command.params if p.name == option]
            assert isinstance(param.type, click.IntRange)
            assert (param.type.min, param.type.max) == (least, most), (role_name, option)


def _compose() -> dict:
    return yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())


def test_the_compose_file_runs_each_role_within_its_scaling() -> None:
    services = _compose()["services"]
    partitions = {name: spec.partitions for name, spec in load_topic_specs().items()}
    seen = set()
    for service in services.values():
        command = service.get("command") or []
        if command[:1] != ["worker"]:
            continue
        spec = role(command[1])
        seen.add(spec.role)
        replicas = service.get("deploy", {}).get("replicas", 1)
        assert spec.scaling.min <= replicas <= spec.scaling.most(partitions), spec.role
        if "--concurrency" in command and "concurrency" in spec.limits:
            value = int(command[command.index("--concurrency") + 1])
            least, most = spec.limit("concurrency")
            assert least <= value <= most
    assert seen == set(load_roles())


def test_the_helm_chart_runs_each_role_within_its_scaling() -> None:
    chart = ROOT / "deploy" / "helm" / "agl-stream"
    values = yaml.safe_load((chart / "values.yaml").read_text())
    partitions = {name: spec.partitions for name, spec in load_topic_specs().items()}
    runner, projector = values["runner"], values["projector"]
    assert (
        role("runner").scaling.min <= runner["replicas"] <= role("runner").scaling.most(partitions)
    )
    least, most = role("runner").limit("concurrency")
    assert least <= runner["concurrency"] <= most
    assert projector["replicas"] <= role("projector").scaling.most(partitions)
    trainer = (chart / "templates" / "trainer.yaml").read_text()
    assert "replicas: 1" in trainer and role("trainer").scaling.max == 1
    for name in load_roles():
        template = (chart / "templates" / f"{name}.yaml").read_text()
        assert f'(list "worker" "{name}"' in template, name
