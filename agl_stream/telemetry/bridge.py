"""A worker's Prometheus registry, as read for a scrape, turned into OTLP metric data (pure).

The registry stays the one source of truth: what /metrics shows and what OTLP exports are
the same collection of the same instruments, so the two can never disagree. Counters become
monotonic cumulative sums (named without `_total`, which a Prometheus exporter adds back),
gauges gauges, histograms explicit-bucket histograms with Prometheus' bounds; labels become
attributes. No worker has other kinds of metric; any other kind is left out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client.metrics_core import Metric as PromMetric
from prometheus_client.samples import Sample

SCOPE = InstrumentationScope("agl_stream.telemetry.metrics")
CUMULATIVE = AggregationTemporality.CUMULATIVE


def metrics_data(
    families: Iterable[PromMetric], resource: Resource, start_ns: int, now_ns: int
) -> MetricsData:
    """One export's data: every family's current values, cumulative since `start_ns`."""
    metrics = [m for family in families if (m := _metric(family, start_ns, now_ns)) is not None]
    scope = ScopeMetrics(scope=SCOPE, metrics=metrics, schema_url="")
    return MetricsData([ResourceMetrics(resource=resource, scope_metrics=[scope], schema_url="")])


def _metric(family: PromMetric, start_ns: int, now_ns: int) -> Metric | None:
    unit = "s" if family.name.endswith("_seconds") else ""
    data: Sum | Gauge | Histogram
    if family.type == "counter":
        points = _points(family.samples, f"{family.name}_total", start_ns, now_ns)
        data = Sum(points, CUMULATIVE, is_monotonic=True)
    elif family.type == "gauge":
        data = Gauge(_points(family.samples, family.name, start_ns, now_ns))
    elif family.type == "histogram":
        data = Histogram(_histogram_points(family, start_ns, now_ns), CUMULATIVE)
    else:
        return None
    if not data.data_points:
        return None  # a labelled family with no series yet: OTLP has no empty metric
    return Metric(name=family.name, description=family.documentation, unit=unit, data=data)


def _points(
    samples: Iterable[Sample], name: str, start_ns: int, now_ns: int
) -> list[NumberDataPoint]:
    return [
        NumberDataPoint(dict(s.labels), start_ns, now_ns, s.value)
        for s in samples
        if s.name == name
    ]


def _histogram_points(family: PromMetric, start_ns: int, now_ns: int) -> list[HistogramDataPoint]:
    """Prometheus' cumulative `le` buckets (the last +Inf) as OTLP's per-bucket counts over
    the finite bounds, one point per label set."""
    series: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    for s in family.samples:
        labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
        one = series.setdefault(labels, {"buckets": [], "count": 0.0, "sum": 0.0})
        if s.name == f"{family.name}_bucket":
            one["buckets"].append((float(s.labels["le"]), s.value))
        elif s.name == f"{family.name}_count":
            one["count"] = s.value
        elif s.name == f"{family.name}_sum":
            one["sum"] = s.value
    points = []
    for labels, one in series.items():
        cumulative = sorted(one["buckets"])
        bounds = [le for le, _ in cumulative if not math.isinf(le)]
        counts, below = [], 0.0
        for _, up_to in cumulative:
            counts.append(int(up_to - below))
            below = up_to
        points.append(HistogramDataPoint(
            attributes=dict(labels), start_time_unix_nano=start_ns, time_unix_nano=now_ns,
            count=int(one["count"]), sum=one["sum"], bucket_counts=counts,
            explicit_bounds=bounds,
            # Prometheus keeps no minimum or maximum: left unset (OTLP's fields are optional).
            min=None, max=None,  # type: ignore[arg-type]
        ))  # fmt: skip
    return points
