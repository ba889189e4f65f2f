"""A worker's OTLP export without a broker: which variables turn it on and where it goes
(pure), the Prometheus registry as OTLP data (pure), and the export itself to a real OTLP
receiver (tests/support/otlp_receiver.py) and to a collector that never answers."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

from agl_stream.runtime.config import ConfigError
from agl_stream.telemetry.bridge import metrics_data
from agl_stream.telemetry.metrics import WorkerMetrics
from agl_stream.telemetry.otlp import exporting
from agl_stream.telemetry.settings import agent_lightning_otlp_endpoint, otlp_settings
from agl_stream.telemetry.spans import NO_TRACER
from tests.support.otlp_receiver import black_hole, otlp_receiver
from tests.support.scrape import parse

FAST = {"OTEL_METRIC_EXPORT_INTERVAL": "100", "OTEL_BSP_SCHEDULE_DELAY": "50"}


def endpoints(env: dict[str, str]) -> tuple[str | None, str | None] | None:
    settings = otlp_settings(env)
    return None if settings is None else (settings.traces_endpoint, settings.metrics_endpoint)


def test_export_is_off_unless_an_endpoint_is_set() -> None:
    assert endpoints({}) is None
    assert endpoints({"OTEL_EXPORTER_OTLP_HEADERS": "a=b", "OTEL_SERVICE_NAME": "x"}) is None
    disabled = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}
    assert endpoints(disabled) is None
    both_off = {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}
    assert endpoints({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", **both_off}) is None


def test_endpoints_follow_the_otlp_http_rules() -> None:
    base = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}
    assert endpoints(base) == ("http://c:4318/v1/traces", "http://c:4318/v1/metrics")
    # A signal's own endpoint is used as it is, and wins over the base.
    own = {**base, "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "https://m.example/otlp"}
    assert endpoints(own) == ("http://c:4318/v1/traces", "https://m.example/otlp")
    assert endpoints({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/x"}) == ("http://t/x", None)
    # OTEL_<SIGNAL>_EXPORTER=none turns one signal off; otlp listed with others keeps it on.
    assert endpoints({**base, "OTEL_TRACES_EXPORTER": "none"}) == (None, "http://c:4318/v1/metrics")
    assert endpoints({**base, "OTEL_METRICS_EXPORTER": "otlp,console"}) == (
        "http://c:4318/v1/traces", "http://c:4318/v1/metrics",
    )  # fmt: skip


def test_agent_lightnings_variable_is_a_traces_url_and_the_otel_ones_win() -> None:
    store = {"AGENT_LIGHTNING_OTLP_ENDPOINT": "http://store:4747/v1/traces"}
    assert agent_lightning_otlp_endpoint(store) == "http://store:4747/v1/traces"
    assert agent_lightning_otlp_endpoint({"AGENT_LIGHTNING_OTLP_ENDPOINT": " "}) is None
    assert endpoints(store) == ("http://store:4747/v1/traces", "http://store:4747/v1/metrics")
    settings = otlp_settings(store)
    assert settings is not None
    assert settings.endpoint_variable == "AGENT_LIGHTNING_OTLP_ENDPOINT"
    # Without the traces path it is a base, as OTEL_EXPORTER_OTLP_ENDPOINT would be.
    assert endpoints({"AGENT_LIGHTNING_OTLP_ENDPOINT": "http://c:4318"}) == (
        "http://c:4318/v1/traces", "http://c:4318/v1/metrics",
    )  # fmt: skip
    both = {**store, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    assert endpoints(both) == ("http://c:4318/v1/traces", "http://c:4318/v1/metrics")


def test_batching_variables_are_read() -> None:
    settings = otlp_settings({
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_METRIC_EXPORT_INTERVAL": "15000",
        "OTEL_BSP_MAX_QUEUE_SIZE": "100", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "10",
        "OTEL_BSP_SCHEDULE_DELAY": "250",
    })  # fmt: skip
    assert settings is not None
    assert settings.metric_interval_seconds == 15.0
    assert (settings.span_queue, settings.span_batch, settings.span_delay_seconds) == (
        100, 10, 0.25,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
         "OTEL_EXPORTER_OTLP_PROTOCOL 'grpc': agl-stream's workers export OTLP as http/protobuf"),
        ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"},
         "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL 'http/json'"),
        ({"OTEL_TRACES_EXPORTER": "zipkin"},
         "OTEL_TRACES_EXPORTER 'zipkin': agl-stream exports its workers' traces by otlp"),
        ({"OTEL_METRIC_EXPORT_INTERVAL": "soon"},
         "OTEL_METRIC_EXPORT_INTERVAL 'soon': expected a positive integer"),
        ({"OTEL_BSP_MAX_QUEUE_SIZE": "0"}, "OTEL_BSP_MAX_QUEUE_SIZE '0'"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"},
         "OTEL_EXPORTER_OTLP_ENDPOINT 'collector:4318': expected an http:// or https:// URL"),
    ],
)  # fmt: skip
def test_settings_that_cannot_be_honoured_are_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match="Invalid setting " + message.replace("(", r"\(")):
        otlp_settings({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", **env})


def test_the_registry_becomes_otlp_metrics_with_the_same_names_and_values() -> None:
    counts = {"rollouts_succeeded": 3, "rollouts_failed": 1, "in_flight": 2, "rejoins": 5}
    metrics = WorkerMetrics("runner", lambda: counts)
    for seconds in (0.003, 0.3, 0.4, 400.0):
        metrics.observe("attempt", seconds, "An attempt.")
    metrics.set("version", 7, "The version.")
    data = metrics_data(metrics.registry.collect(), Resource({"service.name": "r"}), 1, 2)
    [resource] = data.resource_metrics
    named = {m.name: m for m in resource.scope_metrics[0].metrics}
    assert set(named) == {
        "agl_stream_rollouts", "agl_stream_runner_in_flight", "agl_stream_runner_rejoins",
        "agl_stream_runner_attempt_seconds", "agl_stream_runner_version",
    }  # fmt: skip
    rollouts = named["agl_stream_rollouts"].data
    assert rollouts.is_monotonic  # type: ignore[union-attr]
    assert {p.attributes["status"]: p.value for p in rollouts.data_points} == {  # type: ignore[index]
        "succeeded": 3, "failed": 1,
    }  # fmt: skip
    assert [p.value for p in named["agl_stream_runner_in_flight"].data.data_points] == [2]
    histogram = named["agl_stream_runner_attempt_seconds"]
    assert histogram.unit == "s"
    [point] = histogram.data.data_points
    assert point.count == 4  # type: ignore[union-attr]
    assert point.sum == pytest.approx(400.703)  # type: ignore[union-attr]
    # Per bucket, over the finite bounds: 0.005 holds one, 0.5 two, the overflow one.
    assert list(point.explicit_bounds)[:7] == [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5]  # type: ignore[union-attr]
    assert list(point.bucket_counts) == [1, 0, 0, 0, 0, 0, 2, *[0] * 8, 1]  # type: ignore[union-attr]
    # OpenTelemetry's encoder takes it as it is (no minimum or maximum: left unset).
    request = ExportMetricsServiceRequest.FromString(encode_metrics(data).SerializeToString())
    [encoded] = [
        m for m in request.resource_metrics[0].scope_metrics[0].metrics
        if m.name == "agl_stream_runner_attempt_seconds"
    ]  # fmt: skip
    assert not encoded.histogram.data_points[0].HasField("min")


async def test_spans_and_metrics_reach_a_receiver_as_the_standard_variables_say(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-runner")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=team-a")
    counts = {"rollouts_succeeded": 0}
    metrics = WorkerMetrics("runner", lambda: counts)
    # An agent's span, current in this context, from another provider (as the runner's are).
    agent_tracer = TracerProvider().get_tracer("agent")
    async with otlp_receiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, **FAST}
        async with exporting(metrics, "runner-1", otlp_settings(env)):
            with (
                agent_tracer.start_as_current_span("agent's") as agents,
                metrics.tracer.span("runner.attempt", attributes={"agl.rollout_id": "r1"}) as root,
            ):
                with metrics.tracer.span("runner.agent", root):
                    assert trace.get_current_span() is agents  # never made current
                counts["rollouts_succeeded"] = 1
                metrics.observe("attempt", 0.2, "An attempt.")

            await receiver.wait(
                lambda: (
                    len(receiver.spans) == 2
                    and receiver.value("my-runner", "agl_stream_rollouts", status="succeeded") == 1
                )
            )
            scraped = parse(metrics.render().decode())
    assert metrics.tracer is NO_TRACER  # back to nothing once export stops
    [attempt] = receiver.named("runner.attempt")
    assert attempt.parent_span_id == b""  # a root, though an agent's span was current
    assert attempt.trace_id != agents.get_span_context().trace_id.to_bytes(16, "big")
    assert attempt.attributes == {"agl.rollout_id": "r1"}
    assert [c.name for c in receiver.children(attempt)] == ["runner.agent"]
    assert attempt.resource["deployment.environment"] == "test"
    assert attempt.resource["service.instance.id"] == "runner-1"
    assert attempt.resource["agl.role"] == "runner"
    assert all(h.get("x-tenant") == "team-a" for h in receiver.headers)
    # The same values as the Prometheus page.
    histogram = receiver.latest("my-runner", "agl_stream_runner_attempt_seconds")
    assert histogram is not None
    assert histogram.value == scraped[("agl_stream_runner_attempt_seconds_count", ())] == 1
    assert histogram.sum == scraped[("agl_stream_runner_attempt_seconds_sum", ())]
    exported = scraped[("agl_stream_runner_otlp_exported_total", (("signal", "traces"),))]
    assert exported == 2


async def test_a_collector_that_never_answers_costs_only_dropped_data() -> None:
    metrics = WorkerMetrics("runner", lambda: {"in_flight": 0})
    async with black_hole() as url:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_BSP_MAX_QUEUE_SIZE": "8",
               "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4", **FAST}  # fmt: skip
        async with exporting(metrics, "runner-1", otlp_settings(env)):
            for _ in range(100):
                with metrics.tracer.span("runner.attempt"):
                    await asyncio.sleep(0)
            samples = parse(metrics.render().decode())
        # Left without waiting out the exporter's timeout: its export was stuck.
    full = (("reason", "queue_full"), ("signal", "traces"))
    dropped = ("agl_stream_runner_otlp_dropped_total", full)
    # 100 spans, 8 queued at most, one batch of 4 in flight: the rest went as they came.
    assert samples[dropped] >= 100 - 8 - 4
    assert samples[("agl_stream_runner_otlp_exported_total", (("signal", "traces"),))] == 0
