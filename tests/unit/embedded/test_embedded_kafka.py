"""The embedded Kafka's pure parts: the pinned version, node configuration, lane checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

from agl_stream.embedded import kafka_dist
from agl_stream.embedded.kafka_node import KafkaNode, server_properties
from agl_stream.embedded.process import StackError
from agl_stream.runner.lane import Checkpoint, transactional_id


def _props(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines())


def test_the_pom_pins_the_version_the_code_names() -> None:
    assert f"org.apache.kafka:kafka_2.13:{kafka_dist.KAFKA_VERSION}" in kafka_dist.coordinates()
    assert all(c.count(":") == 2 and "${" not in c for c in kafka_dist.coordinates())


def test_one_node_is_broker_and_controller_with_everything_at_one_replica() -> None:
    node = KafkaNode(1, 19092, 19093)
    props = _props(server_properties(node, [node], Path("/h")))
    assert props["process.roles"] == "broker,controller"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:19093"
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093"
    assert props["log.dirs"] == "/h/kafka/node-1"
    for key in ("offsets.topic.replication.factor", "transaction.state.log.replication.factor",
                "transaction.state.log.min.isr", "min.insync.replicas"):  # fmt: skip
        assert props[key] == "1", key
    assert props["auto.create.topics.enable"] == "false"


def test_three_nodes_replicate_three_times_with_two_in_sync() -> None:
    cluster = [KafkaNode(i, 20000 + i, 21000 + i) for i in (1, 2, 3)]
    props = _props(server_properties(cluster[1], cluster, Path("/h")))
    assert props["node.id"] == "2"
    assert props["controller.quorum.voters"] == (
        "1@127.0.0.1:21001,2@127.0.0.1:21002,3@127.0.0.1:21003"
    )
    assert props["transaction.state.log.replication.factor"] == "3"
    assert props["min.insync.replicas"] == "2"
    assert props["transaction.state.log.min.isr"] == "2"


def test_checkpoints_round_trip_and_foreign_metadata_is_none() -> None:
    assert Checkpoint.decode(Checkpoint(1234).encode()) == Checkpoint(1234)
    for junk in (None, "", "not json", '{"other": 1}', '{"rollouts_from": "x"}', "[]"):
        assert Checkpoint.decode(junk) is None


def test_each_tasks_partition_has_its_own_transactional_id() -> None:
    ids = {transactional_id("agl-runners", "agl.tasks", p) for p in range(8)}
    assert len(ids) == 8
    assert transactional_id("agl-runners", "agl.tasks", 3) == "agl-runners.agl.tasks-3"


def test_overrides_add_and_replace_properties_and_a_bad_one_is_named() -> None:
    node = KafkaNode(1, 19092, 19093)
    overrides = {"broker.session.timeout.ms": 4000, "log.retention.check.interval.ms": 5000}
    props = _props(server_properties(node, [node], Path("/h"), overrides=overrides))
    assert props["broker.session.timeout.ms"] == "4000"
    assert props["log.retention.check.interval.ms"] == "5000"
    assert props["node.id"] == "1"
    for bad in ({"a b": 1}, {"x.ms": "1\nnode.id=2"}, {"x.ms": ""}):
        with pytest.raises(StackError, match="broker property override"):
            server_properties(node, [node], Path("/h"), overrides=bad)
