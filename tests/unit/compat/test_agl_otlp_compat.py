"""Agent Lightning 0.3's OTLP span exporter, aimed at a store as its tracer aims it, reaches it
with the OpenTelemetry HTTP exporter installed (agl_stream.compat.agl.otlp_compat; a receiver on
loopback plays the store's /v1/traces)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from agl_stream.compat.agl import otlp_compat
from tests.support.otlp_receiver import otlp_receiver

from agentlightning.instrumentation.agentops import (  # isort: skip  (after agl_stream.compat.agl)
    BypassableAuthenticatedOTLPExporter,
)
from agentlightning.utils.otlp import LightningStoreOTLPExporter  # isort: skip

UNREACHABLE = "http://127.0.0.1:9/v1/traces"  # where the exporters are built to send


def export_one(exporter: Any, name: str) -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.get_tracer("compat-test").start_span(name).end()
    provider.shutdown()  # and the exporter with it


@pytest.mark.parametrize(
    ("exporter_class", "token"),
    [(LightningStoreOTLPExporter, None), (BypassableAuthenticatedOTLPExporter, "agentops-jwt")],
)
async def test_an_aimed_exporter_sends_to_the_store_and_back_to_its_endpoint(
    exporter_class: type[Any], token: str | None
) -> None:
    assert (
        otlp_compat.apply()
    )  # importing agl_stream.compat.agl applied it: a second time is a no-op
    options = {"jwt": token} if token else {}
    exporter = exporter_class(endpoint=UNREACHABLE, **options)
    async with otlp_receiver() as store:
        exporter.enable_store_otlp(f"{store.url}/v1/traces", "ro-1", "at-1")  # as the tracer does
        await asyncio.to_thread(export_one, exporter, "llm-call")
        [span] = store.spans
        assert span.name == "llm-call"
        assert span.resource["agentlightning.rollout_id"] == "ro-1"
        assert span.resource["agentlightning.attempt_id"] == "at-1"
        if token:  # AgentOps' exporter adds its token to the request's headers
            assert store.headers[0]["Authorization"] == f"Bearer {token}"
    exporter.disable_store_otlp()
    client = vars(exporter).get("_client", exporter)  # where OpenTelemetry 1.45 keeps it
    assert exporter._endpoint == client._endpoint == UNREACHABLE


def test_an_exporter_it_does_not_know_is_named_not_patched() -> None:
    assert otlp_compat._missing(SimpleNamespace()) == "its exporter has no _client"
    client = SimpleNamespace(_endpoint="", _headers={}, _transport=SimpleNamespace())
    assert "has no session" in str(otlp_compat._missing(SimpleNamespace(_client=client)))
