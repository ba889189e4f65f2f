"""Deprecated: agl_stream.config is agl_stream.runtime.config now (this path keeps working)."""

import warnings
from typing import Any

from agl_stream.runtime import config as _moved

warnings.warn(
    "agl_stream.config moved to agl_stream.runtime.config", DeprecationWarning, stacklevel=2
)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
