"""`agl-stream ingest otlp`: an OTLP/HTTP receiver (POST /v1/traces, protobuf or JSON) and a
consumer of an OpenTelemetry Collector's Kafka exporter topic (`otlp_proto` encoding), both
publishing the spans as SpanRecorded events (agl_stream.otlp.mapping). A payload that cannot
be read, or whose spans name an attempt they may not join (mapping's rule: the ingester's own
attempts, or another with its key), gets a 400 with the reason (HTTP) or goes to the
dead-letter topic with it (Kafka); neither stops the ingester. Spans are on the broker before
the receiver answers or the consumer commits; a payload sent again is deduplicated by the
span ids. With a token, every request to the receiver (/metrics too; not /health) needs it
as a bearer token, and attempt keys are checked with it."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict

from aiohttp import web
from aiokafka import AIOKafkaProducer
from aiokafka.errors import MessageSizeTooLargeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from agl_stream.bus.codec import Codec
from agl_stream.bus.dead_letters import dead_letter
from agl_stream.bus.kafka import MAX_RECORD_BYTES, consumer
from agl_stream.bus.streams import DLQ_TOPIC, EventPublisher, Topics
from agl_stream.events import SpanRecorded
from agl_stream.events.spans import too_large_stand_in
from agl_stream.otlp.decode import JSON, PROTOBUF, OtlpError, decode_protobuf, decode_request
from agl_stream.otlp.mapping import INPUT, map_request
from agl_stream.runtime.config import KafkaSettings
from agl_stream.runtime.http import Listening, guarded_app
from agl_stream.telemetry.metrics import WorkerMetrics

log = logging.getLogger(__name__)

ANNOUNCED_KEPT = 100_000  # attempts remembered as announced (the oldest are forgotten)
# An exporter sends a batch: OpenTelemetry's BatchSpanProcessor up to 512 spans, a Collector
# what its batch processor gathers; LLM spans carry prompts and answers (tens of KiB each).
# 64 MiB holds 512 spans of 128 KiB; a span over one record's limit becomes a stand-in.
MAX_BODY = 64 * 1024 * 1024


class OtlpIngest:
    """Publishes what OTLP payloads map to; counts what it took and what it refused.
    `secret` checks the keys of spans that join attempts the ingester did not start."""

    def __init__(self, publisher: EventPublisher, secret: str | None = None) -> None:
        self.publisher = publisher
        self.secret = secret
        self.counts: dict[str, int] = {"payloads": 0, "spans": 0, "attempts": 0, "refused": 0}
        self._announced: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._codec = Codec()

    async def ingest(self, request: ExportTraceServiceRequest) -> int:
        """Publish the payload's new attempts, then its spans; returns how many spans."""
        mapped = map_request(request, self.secret)  # OtlpError: nothing is published
        new = [s for key, s in mapped.attempts.items() if key not in self._announced]
        for started in new:
            size = len(self._codec.encode(started))
            if size > MAX_RECORD_BYTES:
                raise OtlpError(
                    f"attempt {started.attempt_id!r} of rollout {started.rollout_id!r} would be "
                    f"{size:,} bytes encoded, over the record limit of {MAX_RECORD_BYTES:,} "
                    f"(its {INPUT}, most likely)"
                )
        await asyncio.gather(*[await self.publisher.send("rollouts", s) for s in new])
        await asyncio.gather(*[await self._send_span(s) for s in mapped.spans])
        for started in new:
            self._announced[(started.rollout_id, started.attempt_id)] = None
        while len(self._announced) > ANNOUNCED_KEPT:
            self._announced.popitem(last=False)
        self.counts["payloads"] += 1
        self.counts["attempts"] += len(new)
        self.counts["spans"] += len(mapped.spans)
        return len(mapped.spans)

    async def _send_span(self, span: SpanRecorded) -> asyncio.Future[object]:
        try:
            return await self.publisher.send("spans", span)
        except MessageSizeTooLargeError:  # as the gateway does: the place is kept, and why
            size = len(self._codec.encode(span))
            self.counts["spans_too_large"] = self.counts.get("spans_too_large", 0) + 1
            stand_in = too_large_stand_in(span, size, MAX_RECORD_BYTES)
            return await self.publisher.send("spans", stand_in)


class OtlpReceiver:
    """OTLP/HTTP: POST /v1/traces. With a token, requests need it as a bearer token (all but
    GET /health: /metrics too)."""

    def __init__(self, ingest: OtlpIngest, token: str | None = None) -> None:
        self.ingest = ingest
        self.token = token
        self.metrics = WorkerMetrics("otlp", lambda: dict(ingest.counts))
        self.url = ""
        self._listening: Listening | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 4318) -> str:
        app = guarded_app(MAX_BODY, self.token, _status_shape)
        app.router.add_post("/v1/traces", self._traces)
        app.router.add_get("/metrics", self.metrics.respond)
        app.router.add_get("/health", _alive)
        self._listening = await Listening.start(app, host, port)
        self.url = self._listening.url
        return self.url

    async def stop(self) -> None:
        if self._listening is not None:
            await self._listening.stop()

    async def _traces(self, request: web.Request) -> web.Response:
        content_type = request.headers.get("Content-Type", "")
        kind = content_type.split(";")[0].strip().lower()
        if kind not in (PROTOBUF, JSON):
            message = f"content type {content_type!r} is not OTLP: send {PROTOBUF} or {JSON}"
            return _status(415, message)
        try:
            payload = decode_request(await request.read(), content_type)
            await self.ingest.ingest(payload)
        except OtlpError as exc:
            self.ingest.counts["refused"] += 1
            return _status(400, str(exc))
        if kind == JSON:
            return web.json_response({})
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(), content_type=PROTOBUF
        )


def _status(status: int, message: str) -> web.Response:
    """OTLP's error answer: a google.rpc.Status (code 3, INVALID_ARGUMENT) as JSON."""
    body = json.dumps({"code": 3, "message": message}).encode()
    return web.Response(status=status, body=body, content_type=JSON)


def _status_shape(status: int, message: str, kind: str) -> web.Response:
    # google.rpc.Code: INVALID_ARGUMENT for what the client sent, INTERNAL for the rest.
    code = 13 if status >= 500 else 3
    body = json.dumps({"code": code, "message": message}).encode()
    return web.Response(status=status, body=body, content_type=JSON)


async def _alive(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def consume_collector_topic(
    kafka: KafkaSettings,
    ingest: OtlpIngest,
    producer: AIOKafkaProducer,
    topic: str,
    group_id: str,
    stop: asyncio.Event,
) -> None:
    """An OpenTelemetry Collector's Kafka exporter topic (`otlp_proto`: one
    ExportTraceServiceRequest a record), read by a consumer group; each batch's spans are on
    the broker before its offsets are committed, and a record that cannot be read goes to
    the dead-letter topic with the reason."""
    topics = Topics(kafka)
    async with consumer(kafka, group_id=group_id, auto_offset_reset="earliest") as reader:
        reader.subscribe([topic])
        while not stop.is_set():
            batches = await reader.getmany(timeout_ms=500, max_records=500)
            for records in batches.values():
                for record in records:
                    try:
                        await ingest.ingest(decode_protobuf(record.value or b""))
                    except OtlpError as exc:
                        ingest.counts["refused"] += 1
                        letter = dead_letter(
                            topic=record.topic, partition=record.partition,
                            offset=record.offset, timestamp_ms=record.timestamp,
                            value=record.value, headers=tuple(record.headers or ()),
                            reason=str(exc), kind="otlp_unreadable", consumer=group_id,
                        )  # fmt: skip
                        await producer.send_and_wait(
                            topics.name(DLQ_TOPIC), letter.value, key=letter.key,
                            headers=letter.headers,
                        )  # fmt: skip
            if batches:
                await reader.commit()
