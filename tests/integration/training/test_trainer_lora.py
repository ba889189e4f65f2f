"""A LoRA run through the real broker on the CPU, with retention: the trainer trains an
adapter on the frozen tiny base and publishes adapter versions ("peft" checkpoints naming the
base), the runners sample them merged in process, the policy server serves them, a restarted
trainer resumes from its latest adapter, and --keep 1 prunes every checkpoint but the last
and those a live version names (here: one a running rollout is pinned to)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import torch
from peft import get_peft_model_state_dict
from safetensors.torch import load_file

from agl_stream.bus.kafka import producer
from agl_stream.commands.resources import ResourceCache, follow_resources
from agl_stream.events import AttemptStatus, Checkpoint, RolloutMode
from agl_stream.runtime.config import KafkaSettings
from agl_stream.serving.server import PolicyServer
from agl_stream.training.checkpoints import CheckpointStore, checkpoint_root, lineage_problems
from agl_stream.training.grpo import GRPOConfig
from agl_stream.training.lora import LoraSettings, load_adapter
from agl_stream.training.model import content_hash, load_policy
from agl_stream.training.sampling import token_batch, token_logprobs
from agl_stream.training.trainer import Trainer, TrainerConfig
from tests.integration.training.test_trainer import enqueue_group_tasks, published
from tests.support import agents
from tests.support.helpers import eventually
from tests.support.runs import queue, runner_in_process, wait_terminal

AGENT = "tests.support.agents:held_echo"
PROMPT = "<bos> a"


@asynccontextmanager
async def policy_server(kafka: KafkaSettings) -> AsyncIterator[PolicyServer]:
    """The policy server following the resources topic, as `agl-stream serve` runs it."""
    server = PolicyServer()
    await server.start("127.0.0.1", 0)
    cache = ResourceCache()
    async with producer(kafka) as prod:
        following = asyncio.gather(
            follow_resources(kafka, prod, cache, "policy-server"),
            server.follow(cache, "policy", None),
        )
        try:
            yield server
        finally:
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
            await server.stop()


async def greedy(url: str) -> tuple[list[int], list[float]]:
    body = {"model": "policy", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/completions", json=body) as response,
    ):
        assert response.status == 200, await response.text()
        choice = (await response.json())["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def scored(model: object, prompt: list[int], answer: list[int]) -> list[float]:
    batch = token_batch([prompt], [answer], pad_id=0)
    with torch.no_grad():
        logp = token_logprobs(model, batch)
    return logp[0][batch.response_mask[0].bool()].tolist()


async def test_a_lora_run_publishes_serves_resumes_and_prunes(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    agents.HELD.clear()
    store = CheckpointStore(str(tmp_path / "checkpoints"))

    def config(max_steps: int) -> TrainerConfig:
        return TrainerConfig(
            checkpoint_dir=str(store.root), run_name="lora", group_size=4, groups_per_step=2,
            max_steps=max_steps, heartbeat_seconds=1.0, lora=LoraSettings(rank=4), keep=1,
            grpo=GRPOConfig(learning_rate=2e-2),
        )  # fmt: skip

    async def version_out(rid: str) -> None:
        async def out() -> bool:
            return any(e.resources_id == rid for e in await published(kafka))

        await eventually(out, 90, f"the trainer to publish {rid}")

    first = Trainer(kafka, config(max_steps=2))
    training = asyncio.create_task(first.run(asyncio.Event()))
    async with runner_in_process(kafka, AGENT, concurrency=8), policy_server(kafka) as server:
        await version_out("lora-v0")
        await enqueue_group_tasks(kafka, "lora-v0", groups=2, size=4)
        await version_out("lora-v1")
        # A rollout pinned to v1 that stays running (its agent waits) keeps v1 live.
        (held,) = await queue(
            kafka, [{"letter": "b", "hold": True}], resources_id="lora-v1", mode=RolloutMode.VAL
        )

        async def only_v1_in_flight() -> bool:  # every v0 rollout's end read, v1's hold too
            return first.in_flight.versions() == {"lora-v1"}

        await eventually(only_v1_in_flight, 60, "the trainer to read v0's ends and the hold")
        await enqueue_group_tasks(kafka, "lora-v1", groups=2, size=4)
        await asyncio.wait_for(training, 120)
        # Step 0 is pruned; step 1 is not the last but a running rollout's version names it.
        assert store.steps() == [1, 2]
        assert (store.root / "base" / "model.safetensors").is_file()

        versions = {e.resources_id: e for e in await published(kafka)}
        base_dir = store.root / "base"
        for step, rid in enumerate(("lora-v0", "lora-v1", "lora-v2")):
            checkpoint = versions[rid].resources["policy"]
            assert isinstance(checkpoint, Checkpoint)
            assert checkpoint.format == "peft"
            assert checkpoint_root(checkpoint.uri) == store.step_dir(step)
            assert checkpoint.base_uri == base_dir.as_uri()
            assert checkpoint.base_content_hash == content_hash(base_dir)
        step2 = store.step_dir(2)
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {
            p.name for p in step2.iterdir()
        }
        assert not list(step2.glob("model*.safetensors"))  # the adapter only
        assert versions["lora-v2"].resources["policy"].content_hash == content_hash(step2)  # type: ignore[union-attr]

        # The policy server serves v2's adapter: its greedy answer scores as the adapter on
        # the base scores it (peft, unmerged), not as the base alone.
        async def serving_v2() -> bool:
            return server.resources_id == "lora-v2"

        await eventually(serving_v2, 60, "the policy server to load lora-v2")
        token_ids, served_logprobs = await greedy(server.url)
        prompt_ids = [1, 4]  # "<bos> a"
        base = load_policy(base_dir)
        adapted = load_adapter(load_policy(base_dir), step2, trainable=False)
        adapted.model.eval()
        expected = scored(adapted.model, prompt_ids, token_ids)
        assert max(abs(a - b) for a, b in zip(served_logprobs, expected, strict=True)) < 1e-4
        on_base = scored(base.model, prompt_ids, token_ids)
        assert max(abs(a - b) for a, b in zip(served_logprobs, on_base, strict=True)) > 1e-3

        # A restarted trainer resumes from its latest adapter: it finds v2 out (publishes
        # nothing new) and goes on training the same adapter.
        saved2 = json.loads((step2 / "trainer.json").read_text())
        second = Trainer(kafka, config(max_steps=3))
        training = asyncio.create_task(second.run(asyncio.Event()))

        async def resumed() -> bool:
            return second.step == 2 and second.resources_id == "lora-v2"

        await eventually(resumed, 60, "the restarted trainer to resume at step 2")
        assert second._policy is not None
        saved_adapter = load_file(step2 / "adapter_model.safetensors")
        resumed_adapter = get_peft_model_state_dict(second._policy.model)
        assert saved_adapter.keys() == resumed_adapter.keys()
        assert all(torch.equal(saved_adapter[k], resumed_adapter[k]) for k in saved_adapter)
        # The held rollout runs on v1, whose checkpoint was kept: it loads and succeeds.
        agents.HELD.set()
        h = await wait_terminal(kafka, [held], 60)
        (attempt,) = h.finished[held]
        assert attempt.status is AttemptStatus.SUCCEEDED, attempt.error

        async def nothing_in_flight() -> bool:
            return second.in_flight.versions() == set()

        await eventually(nothing_in_flight, 60, "the trainer to read the held rollout's end")
        await enqueue_group_tasks(kafka, "lora-v2", groups=2, size=4)
        await asyncio.wait_for(training, 120)

    assert [e.resources_id for e in await published(kafka)] == [
        "lora-v0", "lora-v1", "lora-v2", "lora-v3",
    ]  # fmt: skip
    assert store.steps() == [3]  # v1 is no longer live: pruned with v2
    assert not list(store.root.glob("*.pruned-*"))
    (state3,) = store.lineage()
    assert lineage_problems([saved2, state3]) == []  # step 3 goes on where step 2 ended
    assert state3["counts"]["samples"] == 8 and state3["base"] == saved2["base"]
