"""OTLP ingestion through the real broker and database: the OTLP/HTTP receiver (protobuf,
gzip, JSON; refusals with the reason) and an OpenTelemetry Collector's Kafka exporter topic
(otlp_proto records, one unreadable: a dead letter), into rollouts and spans the read model
shows, deduplicated when sent twice; a reward for an ingested rollout counts."""

from __future__ import annotations

import asyncio
import gzip
import json
import sys

import aiohttp
from aiokafka.admin import NewTopic

from agl_stream.bus.kafka import admin_client, producer
from agl_stream.bus.streams import EventPublisher, Topics
from agl_stream.cli.dlq import read_dead_letters
from agl_stream.commands.rewards import RewardSender
from agl_stream.embedded.process import free_port
from agl_stream.otlp.ingest import OtlpIngest, OtlpReceiver, consume_collector_topic
from agl_stream.queries import ReadModel
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings, child_environment
from tests.support.helpers import eventually, invoke_cli
from tests.support.otlp_payloads import otlp_json, request, span
from tests.support.projection import caught_up, ends, projector_in_process

TOKEN = "otlp-receiver-token"
TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736


async def test_spans_from_otlp_http_and_a_collector_topic_become_rollouts(
    kafka: KafkaSettings, database: DatabaseSettings
) -> None:
    attributed = request(
        [span(TRACE, n, f"step-{n}", parent=1 if n > 1 else None) for n in (1, 2, 3)],
        resource={"agl.rollout.id": "shop-order-7", "agl.rollout.mode": "train"},
    )
    unattributed = request([span(TRACE + 1, 9, "cron")])
    from_collector = request([span(TRACE + 2, 5, "batch-job", **{"agl.rollout.id": "nightly"})])
    collector_topic = f"{kafka.topic_prefix}otlp_spans"
    async with admin_client(kafka) as admin:
        await admin.create_topics([NewTopic(collector_topic, 1, kafka.replication_factor)])

    async with producer(kafka) as prod:
        ingest = OtlpIngest(EventPublisher(prod, Topics(kafka)))
        receiver = OtlpReceiver(ingest, TOKEN)
        url = f"{await receiver.start(port=0)}/v1/traces"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        proto = {**auth, "Content-Type": "application/x-protobuf"}
        try:
            async with aiohttp.ClientSession() as http:
                body = attributed.SerializeToString()
                for _ in range(2):  # an export retried: the same spans once
                    async with http.post(url, data=body, headers=proto) as answer:
                        assert answer.status == 200, await answer.text()
                zipped = {**proto, "Content-Encoding": "gzip"}
                data = gzip.compress(unattributed.SerializeToString())
                async with http.post(url, data=data, headers=zipped) as answer:
                    assert answer.status == 200, await answer.text()
                as_json = json.dumps(otlp_json(attributed)).encode()
                json_headers = {**auth, "Content-Type": "application/json"}
                async with http.post(url, data=as_json, headers=json_headers) as answer:
                    assert answer.status == 200 and await answer.json() == {}
                async with http.post(url, data=b"\xff\xfe", headers=proto) as answer:
                    assert answer.status == 400
                    assert "not an OTLP" in (await answer.json())["message"]
                async with http.post(
                    url, data=b"x", headers={**auth, "Content-Type": "text/csv"}
                ) as answer:
                    assert answer.status == 415
                async with http.post(
                    url, data=body, headers={"Content-Type": "application/x-protobuf"}
                ) as answer:
                    assert answer.status == 401
        finally:
            await receiver.stop()

        await prod.send_and_wait(collector_topic, b"\x0a\xff garbage")
        await prod.send_and_wait(collector_topic, from_collector.SerializeToString())
        stop = asyncio.Event()
        reading = asyncio.create_task(
            consume_collector_topic(kafka, ingest, prod, collector_topic, "otlp-test", stop)
        )

        async def read_both() -> bool:
            assert not reading.done() or reading.exception() is None
            return ingest.counts["refused"] == 2 and ingest.counts["payloads"] == 5

        await eventually(read_both, 60, "the collector topic's records")
        stop.set()
        await reading

    async with RewardSender(kafka) as rewards:  # the ingester announced the attempt
        await rewards.send("shop-order-7", 1.0, name="delivered", source="shop")
    async with projector_in_process(kafka, database):
        wanted = await ends(kafka)
        await eventually(lambda: caught_up(database, wanted), 60, "the projector")
    async with ReadModel.open(database) as rm:
        order = await rm.rollout("shop-order-7")
        assert (order.mode, order.status, order.metadata) == (
            "train",
            "running",
            {"source": "otlp"},
        )
        spans = await rm.spans("shop-order-7")
        assert [s.name for s in spans] == ["step-1", "step-2", "step-3"]
        assert {s.attempt_id for s in spans} == {f"otlp-{TRACE:032x}"}
        assert [s.name for s in await rm.spans(f"otlp-trace-{TRACE + 1:032x}")] == ["cron"]
        assert [s.name for s in await rm.spans("nightly")] == ["batch-job"]
        assert [r.name for r in await rm.rewards("shop-order-7")] == ["delivered"]
    letters = [d for d in await read_dead_letters(kafka, 50) if d.source_topic == collector_topic]
    assert [d.kind for d in letters] == ["otlp_unreadable"]
    assert "not an OTLP ExportTraceServiceRequest" in letters[0].reason


async def test_the_cli_receives_until_it_is_stopped(kafka: KafkaSettings) -> None:
    """`agl-stream ingest otlp` as a user runs it: it listens, takes a payload, and on SIGTERM
    stops saying what it ingested; a command line with nothing to ingest is refused."""
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agl_stream.cli.main", "ingest", "otlp", "--port", str(port),
        env={**child_environment(kafka), "AGL_STREAM_OTLP_TOKEN": TOKEN},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1/traces"
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/x-protobuf"}
    try:
        async with aiohttp.ClientSession() as http:

            async def accepted() -> bool:
                assert process.returncode is None
                body = request([span(TRACE + 3, 1, "cli")]).SerializeToString()
                try:
                    async with http.post(url, data=body, headers=headers) as answer:
                        return answer.status == 200
                except aiohttp.ClientConnectionError:
                    return False

            await eventually(accepted, 60, "the receiver to take a payload")
    finally:
        process.terminate()
        output = (await asyncio.wait_for(process.communicate(), 30))[0].decode()
    assert process.returncode == 0, output
    assert "OTLP/HTTP receiver on" in output and "'spans': 1" in output
    refused = await invoke_cli("ingest", "otlp", "--no-http")
    assert refused.exit_code == 2 and "--no-http needs --collector-topic" in refused.output
