"""The embedded stack: up, down, up keeps what was written; status sees it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agl_stream.bus.kafka import consumer, producer
from agl_stream.bus.streams import EventPublisher, EventStream, Topics
from agl_stream.db.migrate import head_revision
from agl_stream.embedded.kafka_node import KafkaNode, format_storage, write_config
from agl_stream.embedded.process import alive, pick_ports
from agl_stream.embedded.stack import EmbeddedStack, _kafka_id
from agl_stream.runtime.config import KafkaSettings, StackSettings, load
from tests.support.helpers import collect, examples, invoke_cli, traversable
from tests.support.strategies import EVENT_STRATEGIES

pytestmark = pytest.mark.slow


async def _invoke(*args: str) -> str:
    result = await invoke_cli(*args)
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


async def test_up_down_up_keeps_events_and_offsets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = traversable(tmp_path) / "stack"
    broker_port, pg_port = pick_ports(2, 32_000, 32_700)
    flags = [
        "--home",
        str(home),
        "--broker-port",
        str(broker_port),
        "--postgres-port",
        str(pg_port),
    ]
    stack = EmbeddedStack(StackSettings(home=home, broker_port=broker_port, postgres_port=pg_port))
    try:
        output = await _invoke("up", *flags)
        assert f"AGL_STREAM_BOOTSTRAP_SERVERS=127.0.0.1:{broker_port}" in output
        assert "agl-stream embedded stack is up" in output
        await _invoke("up", *flags)  # a second up is harmless
        state = stack.running()
        assert state is not None

        kafka = load(KafkaSettings, bootstrap_servers=state.bootstrap_servers)
        topics = Topics(kafka)
        written = examples(EVENT_STRATEGIES["RolloutQueued"], 30)
        async with producer(kafka) as prod:
            await EventPublisher(prod, topics).publish_many("tasks", written)
            async with consumer(
                kafka, topics.name("tasks"), group_id="keeper", session_timeout_ms=6000
            ) as c:
                got = await collect(EventStream(c, prod, topics, "keeper"), 10)

        await _invoke("down", "--home", str(home))
        assert not any(alive(pid) for pid in state.broker_pids)
        assert stack.running() is None

        await _invoke("up", *flags)
        assert stack.running() is not None
        monkeypatch.setenv("AGL_STREAM_HOME", str(home))  # status names the embedded broker
        report = json.loads(
            await _invoke(
                "--bootstrap-servers",
                state.bootstrap_servers,
                "--database-url",
                state.database_url,
                "status",
                "--json",
            )
        )
        tasks = next(t for t in report["topics"] if t["name"] == "agl.tasks")
        assert sum(tasks["end_offsets"]) == len(written)
        keeper = next(g for g in report["groups"] if g["group"] == "keeper")
        assert keeper["lag"]["agl.tasks"] == len(written) - len(got)
        assert report["database"]["revision"] == head_revision()
        assert report["broker"].startswith(f"Apache Kafka 4.1.1, KRaft, embedded in {home}")
        assert report["broker"].endswith("1 broker")

        async with (
            producer(kafka) as prod,
            consumer(kafka, topics.name("tasks"), group_id="reader") as c,
        ):
            again = await collect(EventStream(c, prod, topics, "reader"), len(written))
        assert {e.event.event_id for e in again} == {e.event_id for e in written}
    finally:
        stack.down()


def test_a_cluster_id_beginning_with_a_dash_formats(tmp_path: Path) -> None:
    """Kafka's ids are URL-safe base64: one in 64 begins with "-", which the storage tool
    took for an option when the id was a separate argument (a stack that failed to start)."""
    node = KafkaNode(node_id=1, port=1, controller_port=2)
    write_config(node, [node], tmp_path)
    cluster_id = "-" + _kafka_id(bytes(16))[1:]
    format_storage([node], tmp_path, cluster_id)
    meta = (node.data_dir(tmp_path) / "meta.properties").read_text()
    assert f"cluster.id={cluster_id}" in meta
