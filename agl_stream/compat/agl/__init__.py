"""Agent Lightning 0.3's store API on agl-stream (optional extra `agl`: agentlightning==0.3.0).

`AglStreamStore` is a LightningStore whose state is agl-stream's topics and read model;
`agl-stream store` serves it over Agent Lightning's HTTP store protocol. Importing it lets
Agent Lightning's OTLP exporter reach a store with OpenTelemetry's HTTP exporter 1.45
(`otlp_compat`).
"""

from __future__ import annotations

import os
import warnings

# Agent Lightning imports LiteLLM's proxy, which fetches a model price list from the network at
# import (three tries, ~7 s, where there is no network) unless told to use its own copy; and
# warns about its own pydantic use. Neither concerns agl-stream.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
        import agentlightning  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "agl_stream.compat.agl needs Agent Lightning 0.3: pip install 'agl-stream[agl]'"
        ) from exc

from agl_stream.compat.agl import otlp_compat
from agl_stream.compat.agl.server import TokenStoreClient
from agl_stream.compat.agl.store import AglStreamStore

# Runner processes forked or started from a script that imports this package export their
# spans to the store through Agent Lightning's OTLP exporter: see otlp_compat.
otlp_compat.apply()

__all__ = ["AglStreamStore", "TokenStoreClient"]
