"""Where torch runs a model and in what precision: `--device`, `--dtype` and `--threads` (or
AGL_STREAM_DEVICE, AGL_STREAM_DTYPE, AGL_STREAM_THREADS) resolved against what torch sees,
once, at start; a setting that cannot be honoured stops the process with a sentence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agl_stream.runtime.config import ConfigError, TorchSettings, load

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Placement:
    """A resolved device and dtype (and the threads, if set)."""

    device: str  # "cpu" or "cuda:N"
    dtype: str  # one of DTYPES
    threads: int | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            self.dtype
        ]

    def describe(self) -> str:
        threads = f", {self.threads} threads" if self.threads else ""
        return f"{self.device}, {self.dtype}{threads}"


CPU = Placement("cpu", "float32")


def resolve(settings: TorchSettings, *, training: bool = False) -> Placement:
    """The placement `settings` ask for, checked against this machine's torch."""
    import torch

    device = settings.device
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto":
        device = "cuda:0" if cuda_count else "cpu"
    elif device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        if not cuda_count:
            raise ConfigError(
                f"Invalid setting --device / AGL_STREAM_DEVICE {settings.device!r}: torch sees "
                "no CUDA device here (torch.cuda.is_available() is False); use --device cpu "
                "or auto."
            )
        if index >= cuda_count:
            raise ConfigError(
                f"Invalid setting --device / AGL_STREAM_DEVICE {settings.device!r}: torch sees "
                f"{cuda_count} CUDA device(s), numbered from 0."
            )
        device = f"cuda:{index}"
    dtype = settings.dtype
    on_gpu = device.startswith("cuda")
    bf16_gpu = on_gpu and torch.cuda.is_bf16_supported()
    if dtype == "auto":
        dtype = "bfloat16" if bf16_gpu else ("float16" if on_gpu and not training else "float32")
    if dtype == "bfloat16" and on_gpu and not bf16_gpu:
        raise ConfigError(
            "Invalid setting --dtype / AGL_STREAM_DTYPE 'bfloat16': this GPU has no bfloat16; "
            "use float16 or float32."
        )
    return Placement(device, dtype, settings.threads)


def placement(
    device: str | None = None,
    dtype: str | None = None,
    threads: int | None = None,
    *,
    training: bool = False,
) -> Placement:
    """Flags (None: not given) over AGL_STREAM_* variables over defaults, resolved."""
    settings = load(TorchSettings, device=device, dtype=dtype, threads=threads)
    return resolve(settings, training=training)


def apply_threads(chosen: Placement, default: int | None) -> None:
    """torch's intra-op threads: the placement's, else the role's default (None: torch's)."""
    import torch

    count = chosen.threads or default
    if count is not None:
        torch.set_num_threads(max(1, count))


def place(model: Any, chosen: Placement) -> Any:
    """Move a model to the placement's device and dtype (in place; returns it)."""
    return model.to(device=chosen.device, dtype=chosen.torch_dtype)


def model_device(model: Any) -> torch.device:
    import torch

    for parameter in model.parameters():
        found: torch.device = parameter.device
        return found
    return torch.device("cpu")
