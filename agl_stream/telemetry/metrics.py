"""Prometheus metrics of a worker (`--metrics-port`).

What a worker counts for its heartbeats is read at scrape time, in the worker's own event
loop (so a scrape sees one consistent snapshot), and named by the rules of `families` (pure).
Durations the worker observes (an attempt, a projector batch, a trainer step) are histograms.
Each worker has a registry of its own, so several workers in one process (tests) stay apart.
Its tracer starts the spans of the worker's units of work; they go nowhere unless OTLP export
is on (agl_stream.telemetry).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agl_stream.runtime.http import Listening, guarded_app
from agl_stream.telemetry.spans import NO_TRACER, WorkerTracer

log = logging.getLogger(__name__)

PREFIX = "agl_stream"
# Counts that go up and down (the rest only grow: counters).
GAUGES = frozenset({
    "ledger_rollouts", "in_flight", "lag", "step", "waiting_trajectories", "pending_rollouts",
    "takeover_ms_last", "round", "sessions_open",
})  # fmt: skip
# Counts with a label: rollouts_succeeded -> agl_stream_rollouts_total{status="succeeded"}
# (a runner's; APO's under agl_stream_apo_).
LABELLED = {"rollouts_": ("rollouts", "status"), "attempts_": ("attempts", "status")}
LABELLED_ROLES = {"runner": PREFIX, "apo": f"{PREFIX}_apo"}
ENDED_BY = {"runner": "this runner ended", "apo": "of APO's batches that ended"}
# Its routes are GETs: a body is never read, and a small one is all a client may send.
METRICS_MAX_BODY = 64 * 1024
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class MetricsError(RuntimeError):
    """The metrics endpoint cannot serve (the message names the setting)."""


def families(role: str, counts: Mapping[str, float]) -> list[Metric]:
    """A worker's counts as metric families (pure): a runner's and APO's `rollouts_*` and
    `attempts_*` by status, the names in GAUGES as gauges, every other count a counter, all
    under agl_stream_<role>_ (a runner's labelled ones under agl_stream_)."""
    labelled: dict[str, CounterMetricFamily] = {}
    out: list[Metric] = []
    for name, value in sorted(counts.items()):
        prefix = next((p for p in LABELLED if name.startswith(p)), None)
        if prefix is not None and role in LABELLED_ROLES:
            metric, label = LABELLED[prefix]
            family = labelled.get(metric)
            if family is None:
                family = labelled[metric] = CounterMetricFamily(
                    f"{LABELLED_ROLES[role]}_{metric}",
                    f"{metric.capitalize()} {ENDED_BY[role]}, by status.", labels=[label],
                )  # fmt: skip
            family.add_metric([name[len(prefix) :]], value)
        elif name in GAUGES:
            out.append(GaugeMetricFamily(f"{PREFIX}_{role}_{name}", _help(name), value=value))
        else:
            out.append(CounterMetricFamily(f"{PREFIX}_{role}_{name}", _help(name), value=value))
    return [*labelled.values(), *out]


def _help(name: str) -> str:
    return f"The worker's {name.replace('_', ' ')} count (as in its heartbeats)."


@dataclass(eq=False)  # registered in a registry's set: hashed by identity
class _Counts(Collector):
    role: str
    read: Callable[[], Mapping[str, float]]
    partitions: Callable[[], Mapping[tuple[str, int], int]] | None

    def collect(self) -> Iterable[Metric]:
        yield from families(self.role, self.read())
        if self.partitions is not None:
            lag = GaugeMetricFamily(
                f"{PREFIX}_{self.role}_partition_lag",
                "Records of an owned partition not yet done, per topic and partition.",
                labels=["topic", "partition"],
            )
            for (topic, partition), value in sorted(self.partitions().items()):
                lag.add_metric([topic, str(partition)], value)
            yield lag


class WorkerMetrics:
    """One worker's registry: its counts (read when scraped) and the histograms it fills; and
    the tracer of its units of work."""

    def __init__(
        self,
        role: str,
        counts: Callable[[], Mapping[str, float]],
        partitions: Callable[[], Mapping[tuple[str, int], int]] | None = None,
    ) -> None:
        self.role = role
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Counts(role, counts, partitions))
        self._histograms: dict[str, Histogram] = {}
        self._gauges: dict[str, Gauge] = {}
        self.started_ns = time.time_ns()  # where its counts start from
        self.tracer: WorkerTracer = NO_TRACER  # a real one while OTLP export runs

    def observe(self, name: str, seconds: float, help_text: str) -> None:
        """Add one duration to the histogram agl_stream_<role>_<name>_seconds."""
        histogram = self._histograms.get(name)
        if histogram is None:
            histogram = self._histograms[name] = Histogram(
                f"{PREFIX}_{self.role}_{name}_seconds", help_text, registry=self.registry,
                buckets=SECONDS_BUCKETS,
            )  # fmt: skip
        histogram.observe(seconds)

    def set(self, name: str, value: float, help_text: str) -> None:
        """Set the gauge agl_stream_<role>_<name> (a value that is not a count)."""
        gauge = self._gauges.get(name)
        if gauge is None:
            gauge = self._gauges[name] = Gauge(
                f"{PREFIX}_{self.role}_{name}", help_text, registry=self.registry
            )
        gauge.set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def respond(self, _: web.Request) -> web.Response:
        """GET /metrics (on a worker's own endpoint, or a server's app)."""
        response = web.Response(body=self.render())
        response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return response


@contextlib.asynccontextmanager
async def serving_metrics(
    metrics: WorkerMetrics | None, host: str, port: int, token: str | None = None
) -> AsyncIterator[int | None]:
    """GET /metrics on host:port while the block runs (in this event loop); nothing when
    `metrics` is None or the port is 0. Yields the port it listens on. With a `token`,
    /metrics needs it as a bearer token (agl_stream.runtime.auth); GET /health stays open (a
    probe)."""
    if metrics is None or not port:
        yield None
        return

    app = guarded_app(METRICS_MAX_BODY, token)
    app.router.add_get("/metrics", metrics.respond)
    app.router.add_get("/health", _alive)
    try:
        listening = await Listening.start(app, host, port)
    except OSError as exc:
        raise MetricsError(
            f"--metrics-port {port}: cannot listen on {host}:{port} ({exc.strerror or exc})"
        ) from None
    log.info("metrics on http://%s:%d/metrics", host, port)
    try:
        yield port
    finally:
        await listening.stop()


async def _alive(_: web.Request) -> web.Response:
    return web.Response(text="ok")
