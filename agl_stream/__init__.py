"""agl-stream: train AI agents over an event-sourced Kafka pipeline."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agl_stream.runtime.version import __version__ as __version__

__all__ = ["APO", "GRPO", "Trainer"]

if TYPE_CHECKING:
    from agl_stream.launch.fit import GRPO, Trainer
    from agl_stream.launch.fit_apo import APO


def __getattr__(name: str) -> Any:
    # Trainer, GRPO and APO pull in the whole stack; importing agl_stream alone stays cheap.
    if name in __all__:
        from agl_stream.launch import fit

        return getattr(fit, name)
    raise AttributeError(f"module 'agl_stream' has no attribute {name!r}")
