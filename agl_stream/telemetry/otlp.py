"""OTLP export of a worker's own traces and metrics, while `exporting` runs (see settings.py
for when it is on).

Traces: the worker's tracer (WorkerMetrics.tracer) records into a provider of its own, whose
finished spans go to a bounded queue and out by OpenTelemetry's OTLP/HTTP span exporter.
Metrics: every OTEL_METRIC_EXPORT_INTERVAL the worker's Prometheus registry is read in the
worker's event loop, as a scrape reads it, and the snapshot goes out by the OTLP/HTTP metric
exporter (bridge.py). Both exporters run on threads; a collector that is slow or gone only
drops data, counted in agl_stream_<role>_otlp_dropped_total{signal,reason}.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.metrics.export import MetricExportResult, MetricsData
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from agl_stream.runtime.config import ConfigError
from agl_stream.runtime.version import __version__
from agl_stream.telemetry.bridge import metrics_data
from agl_stream.telemetry.metrics import PREFIX, WorkerMetrics
from agl_stream.telemetry.queue import ExportQueue
from agl_stream.telemetry.settings import OtlpSettings, otlp_settings
from agl_stream.telemetry.spans import NO_TRACER, WorkerTracer

log = logging.getLogger(__name__)
SHUTDOWN_SECONDS = 3.0  # the last export's time when a worker stops
LOG_SECONDS = 60.0
# The exporters log every failed batch and every retry; one of each message a minute says it.
EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
)


def worker_resource(role: str, worker_id: str) -> Resource:
    """Who exports: OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES where set, else
    service.name agl-stream-<role>, service.instance.id the worker's id, and the role."""
    defaults = {
        "service.name": f"agl-stream-{role.replace('_', '-')}",
        "service.namespace": "agl-stream",
        "service.instance.id": worker_id,
        "service.version": __version__,
        "agl.role": role,
    }
    given = OTELResourceDetector().detect().attributes
    return Resource.create({k: v for k, v in defaults.items() if k not in given})


@contextlib.asynccontextmanager
async def exporting(
    metrics: WorkerMetrics, worker_id: str, settings: OtlpSettings | None = None
) -> AsyncIterator[OtlpSettings | None]:
    """Export the worker's spans and metrics by OTLP while the block runs (in this event
    loop), when the environment asks for it (otherwise nothing). Yields the settings used."""
    settings = settings if settings is not None else otlp_settings()
    if settings is None:
        yield None
        return
    span_exporter_class, metric_exporter_class = _exporter_classes(settings)
    resource = worker_resource(metrics.role, worker_id)
    queues: list[ExportQueue[Any]] = []
    exporters: list[Any] = []
    collecting = None
    for name in EXPORTER_LOGGERS:
        logging.getLogger(name).addFilter(_once_a_minute)
    if settings.traces_endpoint is not None:
        span_exporter = span_exporter_class(endpoint=settings.traces_endpoint)
        exporters.append(span_exporter)
        spans = ExportQueue[ReadableSpan](
            "traces", settings.traces_endpoint,
            lambda batch: span_exporter.export(batch) is SpanExportResult.SUCCESS,
            settings.span_queue, settings.span_batch, settings.span_delay_seconds,
        )  # fmt: skip
        queues.append(spans)
        provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        provider.add_span_processor(_Queueing(spans))
        metrics.tracer = WorkerTracer(provider.get_tracer("agl_stream.worker", __version__))
    if settings.metrics_endpoint is not None:
        metric_exporter = metric_exporter_class(endpoint=settings.metrics_endpoint)
        exporters.append(metric_exporter)
        # One snapshot waits at most: a newer one holds all an older one does (cumulative).
        snapshots = ExportQueue[MetricsData](
            "metrics", settings.metrics_endpoint,
            lambda batch: all(metric_exporter.export(s) is MetricExportResult.SUCCESS
                              for s in batch),
            1, 1, settings.metric_interval_seconds, supersede=True,
        )  # fmt: skip
        queues.append(snapshots)
        collecting = asyncio.create_task(
            _collect(metrics, resource, snapshots, settings.metric_interval_seconds)
        )
    counts = _ExportCounts(metrics.role, queues)
    metrics.registry.register(counts)
    log.info(
        "exporting OTLP (%s): traces to %s, metrics to %s",
        settings.endpoint_variable, settings.traces_endpoint, settings.metrics_endpoint,
    )  # fmt: skip
    try:
        yield settings
    finally:
        metrics.tracer = NO_TRACER
        if collecting is not None:
            collecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collecting
            snapshots.put(_snapshot(metrics, resource))  # the final values
        # Off the loop: the last exports may wait on the network, for SHUTDOWN_SECONDS at most.
        await asyncio.to_thread(_close, queues, exporters)
        metrics.registry.unregister(counts)


def _exporter_classes(settings: OtlpSettings) -> tuple[Any, Any]:
    """OpenTelemetry's OTLP/HTTP exporters, imported only when export is on (the `otlp`
    extra)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise ConfigError(
            f"{settings.endpoint_variable} is set, but OpenTelemetry's OTLP exporter is not "
            "installed: pip install 'agl-stream[otlp]' (or unset it)."
        ) from None
    return OTLPSpanExporter, OTLPMetricExporter


def _close(queues: Iterable[ExportQueue[Any]], exporters: Iterable[Any]) -> None:
    deadline = time.monotonic() + SHUTDOWN_SECONDS
    for queue in queues:
        queue.close(max(0.0, deadline - time.monotonic()))
    for exporter in exporters:
        exporter.shutdown()  # ends a retry still waiting


def _snapshot(metrics: WorkerMetrics, resource: Resource) -> MetricsData:
    return metrics_data(metrics.registry.collect(), resource, metrics.started_ns, time.time_ns())


async def _collect(
    metrics: WorkerMetrics, resource: Resource, queue: ExportQueue[MetricsData], interval: float
) -> None:
    """Read the registry every `interval` seconds in this loop (where the worker's counts
    change, so each read is one consistent snapshot) and queue it for export."""
    while True:
        await asyncio.sleep(interval)
        try:
            queue.put(_snapshot(metrics, resource))
        except Exception:  # a metric that cannot be read must not end the export
            log.exception("the worker's metrics could not be read for OTLP export")


class _Queueing(SpanProcessor):
    """Finished spans into the export queue (on_end runs where the span ends: the loop)."""

    def __init__(self, queue: ExportQueue[ReadableSpan]) -> None:
        self.queue = queue

    def on_end(self, span: ReadableSpan) -> None:
        self.queue.put(span)


@dataclass(eq=False)  # registered in a registry's set: hashed by identity
class _ExportCounts(Collector):
    role: str
    queues: list[ExportQueue[Any]]

    def collect(self) -> Iterable[Metric]:
        exported = CounterMetricFamily(
            f"{PREFIX}_{self.role}_otlp_exported", "Spans and metric snapshots the OTLP "
            "collector took, by signal.", labels=["signal"],
        )  # fmt: skip
        dropped = CounterMetricFamily(
            f"{PREFIX}_{self.role}_otlp_dropped", "Spans and metric snapshots not exported, "
            "by signal and reason (queue_full, export_failed, shutdown).",
            labels=["signal", "reason"],
        )  # fmt: skip
        for queue in self.queues:
            exported.add_metric([queue.signal], queue.exported)
            for reason, count in sorted(queue.dropped.items()):
                dropped.add_metric([queue.signal, reason], count)
        yield exported
        yield dropped


class _OnceAMinute(logging.Filter):
    """Lets each message of the exporters' through once a minute."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: dict[tuple[str, str], float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = time.monotonic()
        if now - self._seen.get(key, -LOG_SECONDS) < LOG_SECONDS:
            return False
        self._seen[key] = now
        return True


_once_a_minute = _OnceAMinute()
