"""`agl-stream ingest otlp`: an OTLP/HTTP receiver (POST /v1/traces, protobuf or JSON) and a
consumer of an OpenTelemetry Collector's Kafka exporter topic (`otlp_proto` encoding), both
publishing the spans as SpanRecorded events (agl_stream.otlp.mapping). A payload that cannot
be read gets a 400 with the reason (HTTP) or goes to the dead-letter topic with it (Kafka);
neither stops the ingester. Spans are on the broker before the receiver answers or the
consumer commits; a payload sent again is deduplicated by the span ids."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict

from aiohttp import web
from aiokafka import AIOKafkaProducer
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from agl_stream.auth import credential_refusal
from agl_stream.config import KafkaSettings
from agl_stream.dead_letters import dead_letter
from agl_stream.kafka import consumer
from agl_stream.metrics import WorkerMetrics
from agl_stream.otlp.decode import JSON, PROTOBUF, OtlpError, decode_protobuf, decode_request
from agl_stream.otlp.mapping import map_request
from agl_stream.streams import DLQ_TOPIC, EventPublisher, Topics

log = logging.getLogger(__name__)

ANNOUNCED_KEPT = 100_000  # attempts remembered as announced (the oldest are forgotten)
MAX_BODY = 64 * 1024 * 1024


class OtlpIngest:
    """Publishes what OTLP payloads map to; counts what it took and what it refused."""

    def __init__(self, publisher: EventPublisher) -> None:
        self.publisher = publisher
        self.counts: dict[str, int] = {"payloads": 0, "spans": 0, "attempts": 0, "refused": 0}
        self._announced: OrderedDict[tuple[str, str], None] = OrderedDict()

    async def ingest(self, request: ExportTraceServiceRequest) -> int:
        """Publish the payload's new attempts, then its spans; returns how many spans."""
        mapped = map_request(request)  # OtlpError: nothing of the payload is published
        new = [s for key, s in mapped.attempts.items() if key not in self._announced]
        await asyncio.gather(*[await self.publisher.send("rollouts", s) for s in new])
        await asyncio.gather(*[await self.publisher.send("spans", s) for s in mapped.spans])
        for started in new:
            self._announced[(started.rollout_id, started.attempt_id)] = None
        while len(self._announced) > ANNOUNCED_KEPT:
            self._announced.popitem(last=False)
        self.counts["payloads"] += 1
        self.counts["attempts"] += len(new)
        self.counts["spans"] += len(mapped.spans)
        return len(mapped.spans)


class OtlpReceiver:
    """OTLP/HTTP: POST /v1/traces. With a token, requests need it as a bearer token."""

    def __init__(self, ingest: OtlpIngest, token: str | None = None) -> None:
        self.ingest = ingest
        self.token = token
        self.metrics = WorkerMetrics("otlp", lambda: dict(ingest.counts))
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 4318) -> str:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/v1/traces", self._traces)
        app.router.add_get("/metrics", self.metrics.respond)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        self.url = f"http://{host}:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _traces(self, request: web.Request) -> web.Response:
        if self.token is not None:
            refused = credential_refusal(request, self.token, "this OTLP receiver")
            if refused is not None:
                return refused
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
