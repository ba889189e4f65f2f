"""Deprecated: agl_stream.enqueue is agl_stream.commands.enqueue now (this path keeps working)."""

import warnings
from typing import Any

from agl_stream.commands import enqueue as _moved

warnings.warn(
    "agl_stream.enqueue moved to agl_stream.commands.enqueue", DeprecationWarning, stacklevel=2
)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
