"""--device, --dtype and --threads (and their AGL_STREAM_* variables): resolved against what
torch sees at start, a setting that cannot be honoured refused with a sentence naming it;
models placed where they say. GPU-only checks are marked `gpu` and run only where torch sees
a CUDA device."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from agl_stream.cli.main import cli
from agl_stream.runtime.config import ConfigError, TorchSettings
from agl_stream.training.batching import TrainSample
from agl_stream.training.device import Placement, apply_threads, placement, resolve
from agl_stream.training.grpo import GRPO, GRPOConfig
from agl_stream.training.lora import LoraSettings, load_adapter, with_adapter
from agl_stream.training.model import (
    initial_policy,
    load_policy,
    save_policy,
    tiny_chat_policy,
    tiny_policy,
)
from agl_stream.training.sampling import sample

NO_GPU = not torch.cuda.is_available()
gpu = pytest.mark.skipif(NO_GPU, reason="torch sees no CUDA device here")


@pytest.mark.skipif(not NO_GPU, reason="checks the CPU-only answers")
def test_auto_is_the_cpu_in_float32_where_torch_sees_no_gpu() -> None:
    assert resolve(TorchSettings()) == Placement("cpu", "float32")
    assert resolve(TorchSettings(), training=True) == Placement("cpu", "float32")
    assert resolve(TorchSettings(dtype="bfloat16", threads=2)) == Placement("cpu", "bfloat16", 2)
    with pytest.raises(ConfigError, match=r"--device / AGL_STREAM_DEVICE 'cuda'.*no CUDA device"):
        resolve(TorchSettings(device="cuda"))
    with pytest.raises(ConfigError, match="'cuda:1'"):
        resolve(TorchSettings(device="cuda:1"))


def test_settings_come_from_the_environment_and_bad_ones_are_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AGL_STREAM_DTYPE", "bfloat16")
    monkeypatch.setenv("AGL_STREAM_THREADS", "3")
    assert placement(device="cpu") == Placement("cpu", "bfloat16", 3)
    assert placement(device="cpu", dtype="float32").dtype == "float32"  # the flag wins
    monkeypatch.setenv("AGL_STREAM_DEVICE", "gpu0")
    with pytest.raises(ConfigError, match=r"AGL_STREAM_DEVICE 'gpu0': expected auto, cpu, cuda"):
        placement()
    monkeypatch.setenv("AGL_STREAM_DEVICE", "cpu")
    monkeypatch.setenv("AGL_STREAM_THREADS", "0")
    with pytest.raises(ConfigError, match="--threads / AGL_STREAM_THREADS"):
        placement()


def test_threads_are_the_settings_else_the_roles_default() -> None:
    before = torch.get_num_threads()
    try:
        apply_threads(Placement("cpu", "float32", 2), default=1)
        assert torch.get_num_threads() == 2
        apply_threads(Placement("cpu", "float32"), default=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not NO_GPU, reason="checks the refusal where there is no GPU")
@pytest.mark.parametrize(
    "command",
    [
        ["serve", "--model", "tiny", "--device", "cuda"],
        ["worker", "trainer", "--checkpoint-dir", "x", "--device", "cuda"],
        ["retrain", "--checkpoint-dir", "x", "--device", "cuda:0"],
    ],
)
def test_a_gpu_that_is_not_there_stops_the_command_with_a_sentence(command: list[str]) -> None:
    result = CliRunner().invoke(cli, command)
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "--device / AGL_STREAM_DEVICE" in text and "torch sees no CUDA device" in text, text
    assert "Traceback" not in result.output


def test_float16_training_of_a_whole_model_is_refused() -> None:
    args = ["worker", "trainer", "--checkpoint-dir", "x", "--device", "cpu"]
    result = CliRunner().invoke(cli, [*args, "--dtype", "float16"])
    assert result.exit_code == 2
    assert "--dtype float16 trains the whole model without loss scaling" in result.output
    result = CliRunner().invoke(cli, [*args, "--lora-rank", "0"])
    assert result.exit_code == 2
    assert "--lora-rank must be at least 1" in result.output


def test_a_checkpoint_loads_in_the_dtype_asked_for(tmp_path: Path) -> None:
    save_policy(tiny_policy(seed=0), tmp_path / "ckpt")
    policy = load_policy(tmp_path / "ckpt", Placement("cpu", "bfloat16"))
    assert {p.dtype for p in policy.model.parameters()} == {torch.bfloat16}
    tiny = initial_policy("tiny", 0, Placement("cpu", "bfloat16"))
    assert {p.dtype for p in tiny.model.parameters()} == {torch.bfloat16}


@pytest.mark.gpu
@gpu
def test_sampling_and_an_update_on_the_gpu_in_bfloat16() -> None:
    """The whole model on cuda in bfloat16: the sampler samples on it, and a micro-batched,
    checkpointed update changes the weights."""
    where = resolve(TorchSettings(device="cuda", dtype="bfloat16"), training=True)
    policy = initial_policy("tiny", 0, where)
    assert next(policy.model.parameters()).device.type == "cuda"
    completion = sample(policy.model.eval(), [1, 6], 4, generator=torch.Generator().manual_seed(1))
    samples = [
        TrainSample(("r", "a"), (1, 6), tuple(completion.token_ids), 1.0, 1.0, 1.0,
                    tuple(completion.logprobs)),
        TrainSample(("r", "b"), (1, 7), (4, 5), 0.0, -1.0, 1.0, None),
    ]  # fmt: skip
    before = [p.detach().clone() for p in policy.model.parameters()]
    config = GRPOConfig(micro_batch_tokens=8, gradient_checkpointing=True)
    stats = GRPO(policy.model, 0, config).update(samples)
    assert math.isfinite(stats.loss)
    assert any(
        not torch.equal(a, b) for a, b in zip(before, policy.model.parameters(), strict=True)
    )


@pytest.mark.gpu
@gpu
def test_auto_is_the_gpu_in_bfloat16_where_torch_sees_one() -> None:
    assert resolve(TorchSettings()) == Placement("cuda:0", "bfloat16")
    assert resolve(TorchSettings(), training=True) == Placement("cuda:0", "bfloat16")
    assert resolve(TorchSettings(device="cuda", dtype="float16")) == Placement("cuda:0", "float16")
    with pytest.raises(ConfigError, match=r"'cuda:99'.*numbered from 0"):
        resolve(TorchSettings(device="cuda:99"))


@pytest.mark.gpu
@gpu
def test_a_checkpoint_loads_onto_the_gpu_in_the_dtype_asked_for(tmp_path: Path) -> None:
    save_policy(tiny_chat_policy(seed=0), tmp_path / "ckpt")
    policy = load_policy(tmp_path / "ckpt", Placement("cuda:0", "bfloat16"))
    assert {(p.device.type, p.dtype) for p in policy.model.parameters()} == {
        ("cuda", torch.bfloat16)
    }


@pytest.mark.gpu
@gpu
def test_a_lora_adapter_trains_on_a_frozen_bfloat16_base_on_the_gpu(tmp_path: Path) -> None:
    """Only the adapter's weights move; saved, it is the adapter alone, and loaded onto a
    fresh base on the GPU it gives the trained model's logits."""
    where = Placement("cuda:0", "bfloat16")
    base = initial_policy("tiny", 0, where)
    policy = with_adapter(base, LoraSettings(rank=4))
    frozen = {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora_" not in n}
    lora = {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora_" in n}
    samples = [
        TrainSample(("r", str(i)), (1, 5 + i % 4), (4, 5 + i % 4), float(i % 2),
                    1.0 - 2 * (i % 2), 1.0, None)
        for i in range(8)
    ]  # fmt: skip
    config = GRPOConfig(micro_batch_tokens=8, gradient_checkpointing=True)
    GRPO(policy.model, 0, config).update(samples)
    after = dict(policy.model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in frozen.items())
    assert any(not torch.equal(after[n], p) for n, p in lora.items())
    save_policy(policy, tmp_path / "adapter")
    saved = {f.name for f in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= saved
    assert "model.safetensors" not in saved
    loaded = load_adapter(initial_policy("tiny", 0, where), tmp_path / "adapter", trainable=False)
    ids = torch.tensor([[1, 6, 7, 8]], device="cuda:0")
    with torch.no_grad():
        expected = policy.model.eval()(input_ids=ids).logits
        got = loaded.model.eval()(input_ids=ids).logits
    torch.testing.assert_close(got, expected)  # bfloat16's tolerances


@pytest.mark.gpu
@gpu
async def test_the_policy_server_answers_from_the_gpu_as_transformers_does(tmp_path: Path) -> None:
    """`serve --device cuda`: a published checkpoint is loaded onto the GPU and its greedy
    answer is transformers' own generate() on the same weights there (float32, so that the
    two paths' kernels cannot turn a near tie the other way)."""
    import aiohttp

    from agl_stream.commands.resources import ResourceCache
    from agl_stream.events import Checkpoint, ResourcesPublished
    from agl_stream.serving.server import PolicyServer
    from agl_stream.training.model import content_hash

    where = Placement("cuda:0", "float32")
    save_policy(tiny_chat_policy(seed=3), tmp_path / "v1")
    checkpoint = Checkpoint(
        uri=(tmp_path / "v1").as_uri(), content_hash=content_hash(tmp_path / "v1")
    )
    cache = ResourceCache()
    server = PolicyServer(placement=where)
    following = asyncio.create_task(server.follow(cache, "policy", None))
    url = await server.start("127.0.0.1", 0)
    try:
        cache.apply(
            ResourcesPublished(resources_id="v1", version=1, resources={"policy": checkpoint})
        )
        while server.resources_id != "v1":
            await asyncio.wait_for(server._moved.wait(), 60)
        body = {"model": "policy", "prompt": "<|user|>hi<|end|><|assistant|>", "max_tokens": 8,
                "temperature": 0}  # fmt: skip
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{url}/v1/completions", json=body) as response,
        ):
            assert response.status == 200, await response.text()
            choice = (await response.json())["choices"][0]
    finally:
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
        await server.stop()
    reference = load_policy(tmp_path / "v1", where)
    prompt = torch.tensor([choice["prompt_token_ids"]], device="cuda:0")
    with torch.no_grad():
        out = reference.model.eval().generate(
            prompt, max_new_tokens=8, do_sample=False,
            pad_token_id=reference.tokenizer.pad_token_id,
            eos_token_id=reference.tokenizer.eos_token_id,
        )  # fmt: skip
    assert choice["token_ids"] == out[0, prompt.shape[1] :].tolist()
