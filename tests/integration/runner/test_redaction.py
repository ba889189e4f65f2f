"""Redaction in the runner: a runner process started with `--redact-pattern email
--redact-pattern api_key` runs an agent that puts an e-mail address and an API key into its
spans; on the spans topic (read as raw bytes, every partition) neither appears, the attributes
say what was removed, and the rest of the span is as the agent made it."""

from __future__ import annotations

import asyncio
import sys

from aiokafka import TopicPartition

from agl_stream.bus.kafka import consumer
from agl_stream.bus.streams import Topics
from agl_stream.runtime.config import KafkaSettings, child_environment
from tests.support.runs import queue, wait_terminal

EMAIL = "ann.lee@example.com"
KEY = "sk-" + "Zx9" * 12


async def raw_records(kafka: KafkaSettings, short: str) -> list[bytes]:
    topics = Topics(kafka)
    tps = [TopicPartition(topics.name(short), p) for p in range(topics.specs[short].partitions)]
    async with consumer(kafka) as client:
        client.assign(tps)
        ends = await client.end_offsets(tps)
        await client.seek_to_beginning(*tps)
        values: list[bytes] = []

        async def behind() -> bool:
            return any([await client.position(tp) < ends[tp] for tp in tps])

        while await behind():
            batch = await client.getmany(timeout_ms=500)
            values += [r.value for records in batch.values() for r in records]
    return values


async def test_the_runner_redacts_spans_before_they_leave_it(kafka: KafkaSettings) -> None:
    ids = await queue(kafka, [{"email": EMAIL, "key": KEY}] * 3)
    runner = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agl_stream.cli.main", "worker", "runner",
        "--agent", "tests.support.agents:leaky", "--redact-pattern", "email",
        "--redact-pattern", "api_key", "--heartbeat", "1",
        env=child_environment(kafka), stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        h = await wait_terminal(kafka, ids, 60)
    finally:
        runner.terminate()
        _, err = await runner.communicate()
    assert runner.returncode == 0, err.decode()
    messages = [
        span
        for r in ids
        for span in h.spans[h.finished[r][0].attempt_id]
        if span.name == "agl.message"
    ]
    assert len(messages) == 3
    for span in messages:
        assert span.attributes["agl.message"] == "mail [REDACTED:email] with [REDACTED:api_key]"
        assert span.attributes["api_key"] == "[REDACTED]"  # a secret's name: replaced whole
        assert span.attributes["to"] == "[REDACTED:email]"
    raw = await raw_records(kafka, "spans")
    assert raw and not any(EMAIL.encode() in v or KEY.encode() in v for v in raw)
