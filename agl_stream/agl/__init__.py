"""Deprecated: agl_stream.agl is agl_stream.compat.agl now (this path keeps working)."""

import warnings
from typing import Any

from agl_stream.compat import agl as _moved

warnings.warn("agl_stream.agl moved to agl_stream.compat.agl", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
