"""topics apply is idempotent and reports drift; workers refuse wrong or missing topics."""

from __future__ import annotations

import pytest
from aiokafka.admin import NewTopic

from agl_stream.bus.kafka import admin_client
from agl_stream.bus.topic_admin import (
    TopicsNotReady,
    apply_topics,
    ensure_topics_ready,
    observe_topics,
)
from agl_stream.bus.topic_spec import load_topic_specs
from agl_stream.runtime.config import KafkaSettings, load
from tests.support.backends import Backend
from tests.support.helpers import invoke_cli


@pytest.fixture
def bare(backend: Backend, unique: str) -> KafkaSettings:
    """Settings whose topics do not exist yet."""
    return load(
        KafkaSettings, bootstrap_servers=backend.bootstrap_servers, topic_prefix=f"b{unique}."
    )


def flags(settings: KafkaSettings) -> list[str]:
    """The CLI flags that point at these settings' broker and topics."""
    return [
        "--bootstrap-servers",
        settings.bootstrap_servers,
        "--topic-prefix",
        settings.topic_prefix,
    ]


async def test_apply_creates_then_changes_nothing(bare: KafkaSettings) -> None:
    first = await apply_topics(bare)
    assert len(first.created) == len(load_topic_specs())
    second = await apply_topics(bare)
    assert second.created == () and second.altered == () and second.unfixed == ()
    assert len(second.in_sync) == len(first.created)
    observed = await observe_topics(bare, second.in_sync)
    spec = load_topic_specs()["resources"]
    seen = observed[bare.topic("resources")]
    assert seen.partitions == spec.partitions
    assert seen.configs["cleanup.policy"] == "compact"


async def test_missing_topics_stop_a_worker_with_the_fix(bare: KafkaSettings) -> None:
    with pytest.raises(TopicsNotReady) as info:
        await ensure_topics_ready(bare, ["tasks", "rollouts"])
    message = str(info.value)
    assert f"topic {bare.topic('tasks')} does not exist: run `agl-stream topics apply`" in message
    await apply_topics(bare)
    await ensure_topics_ready(bare, ["tasks", "rollouts"])


async def test_wrong_partition_count_is_drift_that_apply_will_not_hide(bare: KafkaSettings) -> None:
    async with admin_client(bare) as admin:
        await admin.create_topics(
            [
                NewTopic(
                    bare.topic("tasks"), 2, 1, topic_configs=load_topic_specs()["tasks"].configs()
                )
            ]
        )
    report = await apply_topics(bare)
    assert [(d.topic, d.setting, d.actual, d.expected) for d in report.unfixed] == [
        (bare.topic("tasks"), "partitions", "2", "8")
    ]
    with pytest.raises(TopicsNotReady, match="partitions is 2, expected 8"):
        await ensure_topics_ready(bare, ["tasks"])
    result = await invoke_cli(*flags(bare), "topics", "check", "tasks")
    assert result.exit_code == 1
    assert "partitions is 2, expected 8" in result.output
    result = await invoke_cli(*flags(bare), "topics", "apply")
    assert result.exit_code == 1
    assert "drift" in result.output


async def test_config_drift_is_fixed_or_reported_never_silent(bare: KafkaSettings) -> None:
    spec = load_topic_specs()["spans"]
    async with admin_client(bare) as admin:
        wrong = {**spec.configs(), "retention.ms": "1000"}
        await admin.create_topics(
            [NewTopic(bare.topic("spans"), spec.partitions, 1, topic_configs=wrong)]
        )
    report = await apply_topics(bare, [spec])
    drift = [(d.setting, d.actual, d.expected) for d in (*report.altered, *report.unfixed)]
    assert drift == [("retention.ms", "1000", str(spec.retention_ms))]
    observed = (await observe_topics(bare, [bare.topic("spans")]))[bare.topic("spans")]
    if report.altered:  # the broker can alter configs in place (Apache Kafka)
        assert observed.configs["retention.ms"] == str(spec.retention_ms)
    else:  # it cannot (the embedded broker): `topics apply` keeps saying so, and fails
        result = await invoke_cli(*flags(bare), "topics", "apply")
        assert result.exit_code == 1
        assert "retention.ms is 1000" in result.output
    await ensure_topics_ready(bare, ["spans"])  # retention alone does not stop a worker
