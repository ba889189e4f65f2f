"""Deprecated: agl_stream.late_rewards is agl_stream.commands.rewards now (this path keeps
working)."""

import warnings
from typing import Any

from agl_stream.commands import rewards as _moved

warnings.warn(
    "agl_stream.late_rewards moved to agl_stream.commands.rewards", DeprecationWarning, stacklevel=2
)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
