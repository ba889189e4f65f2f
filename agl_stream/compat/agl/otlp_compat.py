"""Agent Lightning 0.3's OTLP span exporter on OpenTelemetry's HTTP exporter 1.45.

A runner that talks to a store over HTTP (Agent Lightning's `LightningStoreClient`) sends its
agent's spans, the LLM calls among them, through `LightningStoreOTLPExporter`, which it aims at
the store's /v1/traces by setting the exporter's `_endpoint` (agentlightning/utils/otlp.py,
`enable_store_otlp`); AgentOps 0.4's `AuthenticatedOTLPExporter`, the base of the exporter the
AgentOps tracer uses, adds its token to the exporter's `_headers` and `_session`
(agentops/sdk/exporters.py, `_prepare_headers` and `export`). OpenTelemetry's HTTP exporter
1.45 keeps endpoint, headers and session in the HTTP client it builds at construction
(`_client`): the AgentOps exporter fails on the missing `_headers` ("has no attribute
'_headers'"), the plain one posts to the endpoint it was built with, and only the rewards,
which the runner sends by other calls, reach the store.

`apply()` gives Agent Lightning's exporter class the three attributes back as views of its
client's, so that setting `_endpoint` aims the client again. A shim, not a pin of the HTTP
exporter below 1.45: the exporter pins the SDK to its own version (1.45.2 requires
opentelemetry-sdk~=1.45.2), so a pin would hold back the OpenTelemetry of the whole
environment, agl-stream's own tracing and OTLP export included, for one class of Agent
Lightning's (which itself asks for 1.35 or later). The shim touches that class alone: where
its exporter still has the attributes (before 1.45, or once applied) it changes nothing, and
where it has neither them nor the client it knows, it logs why it cannot help.
"""

from __future__ import annotations

import logging
from typing import Any

from agentlightning.utils.otlp import LightningStoreOTLPExporter

log = logging.getLogger(__name__)

_PROBE_ENDPOINT = "http://127.0.0.1:4318/v1/traces"  # never contacted


def _get_endpoint(exporter: Any) -> Any:
    return vars(exporter).get("_endpoint")


def _set_endpoint(exporter: Any, endpoint: Any) -> None:
    # The exporter's __init__ sets `_endpoint` before it builds the client from it.
    vars(exporter)["_endpoint"] = endpoint
    client = vars(exporter).get("_client")
    if client is not None:
        client._endpoint = endpoint


def _get_headers(exporter: Any) -> Any:
    return exporter._client._headers


def _get_session(exporter: Any) -> Any:
    return exporter._client._transport._session


def _missing(probe: Any) -> str | None:
    """What in `probe`'s layout the shim does not know, or None if it knows it all."""
    client = vars(probe).get("_client")
    if client is None:
        return "its exporter has no _client"
    for owner, name in ((client, "_endpoint"), (client, "_headers"), (client, "_transport")):
        if not hasattr(owner, name):
            return f"its exporter's client has no {name}"
    if not hasattr(client._transport, "_session"):
        return f"its exporter's transport ({type(client._transport).__name__}) has no session"
    return None


def apply() -> bool:
    """Let Agent Lightning aim its OTLP exporter at a store again; True if it now can."""
    probe = LightningStoreOTLPExporter(endpoint=_PROBE_ENDPOINT)
    try:
        if all(hasattr(probe, name) for name in ("_endpoint", "_headers", "_session")):
            return True  # before OpenTelemetry 1.45, or applied already
        missing = _missing(probe)
    finally:
        probe.shutdown()
    if missing is not None:
        log.warning(
            "agl_stream.compat.agl cannot adapt Agent Lightning's OTLP exporter to this "
            "OpenTelemetry HTTP exporter (%s): spans that runner processes export will not "
            "reach the store",
            missing,
        )
        return False
    cls: Any = LightningStoreOTLPExporter
    cls._endpoint = property(_get_endpoint, _set_endpoint)
    cls._headers = property(_get_headers)
    cls._session = property(_get_session)
    log.debug("agl_stream.compat.agl: Agent Lightning's OTLP exporter aims its HTTP client")
    return True
