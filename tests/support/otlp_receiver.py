"""An OTLP/HTTP receiver for tests: an aiohttp server that decodes what exporters POST to
/v1/traces and /v1/metrics with opentelemetry-proto, as a collector would, and keeps it."""

from __future__ import annotations

import asyncio
import gzip
import zlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from agl_stream.embedded.process import free_port


def attributes(values: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in values if isinstance(kv, KeyValue)}


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


@dataclass(frozen=True)
class SpanSeen:
    service: str
    resource: dict[str, Any]
    name: str
    attributes: dict[str, Any]
    trace_id: bytes
    span_id: bytes
    parent_span_id: bytes
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str


@dataclass(frozen=True)
class PointSeen:
    service: str
    resource: dict[str, Any]
    metric: str
    kind: str  # sum, gauge, histogram
    attributes: dict[str, Any]
    value: float  # a histogram's count
    monotonic: bool = False
    sum: float = 0.0
    bucket_counts: tuple[int, ...] = ()
    bounds: tuple[float, ...] = ()
    unit: str = ""


@dataclass
class Receiver:
    url: str = ""
    spans: list[SpanSeen] = field(default_factory=list)
    points: list[PointSeen] = field(default_factory=list)  # every export's, in order
    headers: list[dict[str, str]] = field(default_factory=list)
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait(self, condition: Callable[[], bool], within: float = 60.0) -> None:
        """Until `condition` holds, looked at after each export arrives."""
        try:
            async with asyncio.timeout(within):
                while not condition():
                    await self._arrived.wait()
        except TimeoutError:
            raise AssertionError(f"not received within {within} s: {condition}") from None

    def _woken(self) -> None:
        arrived, self._arrived = self._arrived, asyncio.Event()
        arrived.set()

    def named(self, name: str, service: str | None = None) -> list[SpanSeen]:
        return [s for s in self.spans if s.name == name and service in (None, s.service)]

    def children(self, parent: SpanSeen) -> list[SpanSeen]:
        return [
            s for s in self.spans
            if s.trace_id == parent.trace_id and s.parent_span_id == parent.span_id
        ]  # fmt: skip

    def latest(self, service: str, metric: str, **labels: Any) -> PointSeen | None:
        """The last exported point of a metric with exactly these attributes."""
        found = [
            p for p in self.points
            if p.service == service and p.metric == metric and p.attributes == labels
        ]  # fmt: skip
        return found[-1] if found else None

    def value(self, service: str, metric: str, **labels: Any) -> float:
        point = self.latest(service, metric, **labels)
        return point.value if point is not None else 0.0

    async def _traces(self, request: web.Request) -> web.Response:
        message = ExportTraceServiceRequest.FromString(await _body(request))
        self.headers.append(dict(request.headers))
        for resource_spans in message.resource_spans:
            resource = attributes(resource_spans.resource.attributes)
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.spans.append(SpanSeen(
                        resource["service.name"], resource, span.name,
                        attributes(span.attributes), span.trace_id, span.span_id,
                        span.parent_span_id, span.status.code, span.status.message,
                    ))  # fmt: skip
        self._woken()
        return _answer(ExportTraceServiceResponse().SerializeToString())

    async def _metrics(self, request: web.Request) -> web.Response:
        message = ExportMetricsServiceRequest.FromString(await _body(request))
        self.headers.append(dict(request.headers))
        for resource_metrics in message.resource_metrics:
            resource = attributes(resource_metrics.resource.attributes)
            service = resource["service.name"]
            for scope in resource_metrics.scope_metrics:
                for metric in scope.metrics:
                    self.points += _points(service, resource, metric)
        self._woken()
        return _answer(ExportMetricsServiceResponse().SerializeToString())


def _points(service: str, resource: dict[str, Any], metric: Any) -> list[PointSeen]:
    kind = metric.WhichOneof("data")
    assert kind is not None, f"metric {metric.name} has no data"
    if kind == "histogram":
        return [
            PointSeen(service, resource, metric.name, kind, attributes(p.attributes), p.count,
                      sum=p.sum, bucket_counts=tuple(p.bucket_counts),
                      bounds=tuple(p.explicit_bounds), unit=metric.unit)
            for p in metric.histogram.data_points
        ]  # fmt: skip
    data = getattr(metric, kind)
    return [
        PointSeen(service, resource, metric.name, kind, attributes(p.attributes),
                  p.as_double if p.WhichOneof("value") == "as_double" else p.as_int,
                  monotonic=kind == "sum" and data.is_monotonic, unit=metric.unit)
        for p in data.data_points
    ]  # fmt: skip


async def _body(request: web.Request) -> bytes:
    body = await request.read()
    encoding = request.headers.get("Content-Encoding", "")
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "deflate":
        return zlib.decompress(body)
    return body


def _answer(body: bytes) -> web.Response:
    return web.Response(body=body, content_type="application/x-protobuf")


@asynccontextmanager
async def otlp_receiver() -> AsyncIterator[Receiver]:
    """A receiver listening on 127.0.0.1; its `url` is the base OTEL_EXPORTER_OTLP_ENDPOINT."""
    receiver = Receiver()
    app = web.Application()
    app.router.add_post("/v1/traces", receiver._traces)
    app.router.add_post("/v1/metrics", receiver._metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    receiver.url = f"http://127.0.0.1:{port}"
    try:
        yield receiver
    finally:
        await runner.cleanup()


@asynccontextmanager
async def black_hole() -> AsyncIterator[str]:
    """A collector that accepts connections and never answers: its base URL."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    port = free_port()
    server = await asyncio.start_server(hold, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for writer in held:
            writer.close()
        server.close()
