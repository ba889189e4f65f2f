"""--device, --dtype and --threads (and their AGL_STREAM_* variables): resolved against what
torch sees at start, a setting that cannot be honoured refused with a sentence naming it;
models placed where they say. GPU-only checks are marked `gpu` and run only where torch sees
a CUDA device."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from agl_stream.cli.main import cli
from agl_stream.config import ConfigError, TorchSettings
from agl_stream.training.batching import TrainSample
from agl_stream.training.device import Placement, apply_threads, placement, resolve
from agl_stream.training.grpo import GRPO, GRPOConfig
from agl_stream.training.model import initial_policy, load_policy, save_policy, tiny_policy
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
        ["worker", "--role", "trainer", "--checkpoint-dir", "x", "--device", "cuda"],
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
    args = ["worker", "--role", "trainer", "--checkpoint-dir", "x", "--device", "cpu"]
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
