"""deploy/'s image, built with podman (deploy/image/build.sh: a Debian base from mmdebstrap, no
Docker engine or registry) and run: every role's command starts, and a runner and a projector
in containers (host network) take a task queued from here through to the read model.

Marked `image` (`-m "not image"` leaves it out): 2 minutes here with nothing built before
(mmdebstrap, the image, the test), 2 with the layers cached (the build ~1 of it, of which
the roles' --help 20-25 s); add the install of podman, buildah, mmdebstrap and runc on a
bare machine. It skips only where no container can run at all."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from agl_stream.queries import NotFound, ReadModel
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings, child_environment
from tests.support.helpers import eventually, traversable

pytestmark = [pytest.mark.image, pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[3]
BUILD = ROOT / "deploy" / "image" / "build.sh"
IMAGE = "localhost/agl-stream:slim"
BASE = "localhost/agl-stream-base:bookworm"
PODMAN_ENV = {**os.environ, "CONTAINERS_CONF": str(ROOT / "deploy" / "image" / "containers.conf")}

# The agent the containers' runner runs (mounted into them: the image holds only agl_stream).
AGENT = """
from agl_stream.agent import emit_message, rollout

@rollout
def shout(task):
    emit_message(task["word"].upper())
    return 1.0 if task["word"] else 0.0
"""


def build(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", str(BUILD), *args], env=PODMAN_ENV, capture_output=True, text=True, check=False
    )


def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["podman", *args], env=PODMAN_ENV, capture_output=True, text=True, check=check, timeout=300
    )


# Session-scoped: pytest runs this module's backend-parametrised test among the other
# modules' tests on that backend, and a module-scoped build would run twice.
@pytest.fixture(scope="session")
def built() -> Iterator[subprocess.CompletedProcess[str]]:
    """`build.sh agl s3`: the slim image built, then its entry point and each role's --help run.
    The build stage's image is removed afterwards (the base and the slim image stay, and the
    next build starts from them)."""
    if shutil.which("podman") is None and os.geteuid() != 0:
        pytest.skip("containers cannot run here: no podman, and not root to install it")
    base = build("base")  # podman and mmdebstrap installed where missing, the base imported
    assert base.returncode == 0, base.stdout[-3000:] + base.stderr[-3000:]
    probe = podman("run", "--rm", "--network=host", BASE, "true", check=False)
    if probe.returncode != 0:
        pytest.skip(f"containers cannot run here: `podman run` failed: {probe.stderr[-500:]}")
    yield build("agl", "s3")
    podman("image", "prune", "--force", check=False)


@pytest.fixture(scope="session")
def image(built: subprocess.CompletedProcess[str]) -> str:
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return IMAGE


def test_every_role_starts(image: str, built: subprocess.CompletedProcess[str]) -> None:
    assert f"{image}: agl-stream --help and every role's --help run" in built.stdout


@contextlib.asynccontextmanager
async def container(
    image: str, env: dict[str, str], mounts: list[str], *command: str
) -> AsyncIterator[str]:
    name = f"agl-test-{uuid.uuid4().hex[:8]}"
    args = ["run", "-d", "--rm", "--network=host", "--name", name]
    for key, value in env.items():
        args += ["-e", f"{key}={value}"]
    for mount in mounts:
        args += ["-v", mount]
    await asyncio.to_thread(podman, *args, image, *command)
    try:
        yield name
    finally:
        logs = await asyncio.to_thread(podman, "logs", name, check=False)
        await asyncio.to_thread(podman, "stop", "-t", "10", name, check=False)
        sys.stderr.write(f"--- {' '.join(command)} ---\n{logs.stdout[-3000:]}{logs.stderr[-3000:]}")


async def test_a_task_runs_in_a_runner_container_and_a_projector_container_projects_it(
    image: str, kafka: KafkaSettings, database: DatabaseSettings, tmp_path: Path
) -> None:
    agents = traversable(tmp_path / "agents")
    (agents / "image_agent.py").write_text(AGENT)
    (agents / "image_agent.py").chmod(0o644)
    env = {
        k: v for k, v in child_environment(kafka, database).items() if k.startswith("AGL_STREAM_")
    }
    env["PYTHONPATH"] = "/agents"
    mounts = [f"{agents}:/agents:ro"]
    async with (
        container(image, env, mounts, "worker", "runner", "--agent", "image_agent:shout"),
        container(image, env, [], "worker", "projector"),
    ):
        tasks = "".join(json.dumps({"rollout_id": f"img-{n}", "word": w}) + "\n"
                        for n, w in enumerate(["ship", "it"]))  # fmt: skip
        enqueued = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agl_stream.cli.main", "enqueue",
            env=child_environment(kafka), stdin=asyncio.subprocess.PIPE,
        )  # fmt: skip
        await enqueued.communicate(tasks.encode())
        assert enqueued.returncode == 0

        async with ReadModel.open(database) as model:

            async def projected() -> bool:
                try:
                    rows = [await model.rollout(f"img-{n}") for n in range(2)]
                except NotFound:
                    return False
                return all(r.status == "succeeded" and r.reward == 1.0 for r in rows)

            await eventually(projected, 180, "both tasks to succeed in the read model")
