"""What `agl-stream status` makes of the projection: every partition of the projected topics,
those the read model never stored included, and which of them are stuck."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from agl_stream.commands.status import (
    STALL,
    GroupStatus,
    PartitionProjection,
    StatusReport,
    TopicStatus,
    projection_status,
)
from agl_stream.runtime.config import KafkaSettings, load

NOW = datetime(2026, 11, 27, 12, tzinfo=UTC)


def test_every_partition_of_the_projected_topics_is_listed_with_its_lag() -> None:
    kafka = load(KafkaSettings, topic_prefix="p.")
    topics = [
        TopicStatus("p.tasks", 2, (5, 0)),
        TopicStatus("p.dlq", 1, (9,)),  # not projected
    ]
    stored = {("p.tasks", 0): (3, NOW)}
    found = projection_status(topics, stored, ("tasks",), kafka)
    assert found == [
        PartitionProjection("p.tasks", 0, 3, 5, NOW),
        PartitionProjection("p.tasks", 1, 0, 0, None),
    ]
    assert [p.lag for p in found] == [2, 0]


def _report(projectors: int, *parts: PartitionProjection) -> StatusReport:
    report = StatusReport("b:9092", True, projector_group="p-projector", checked_at=NOW)
    report.groups = [GroupStatus("p-projector", "Stable", projectors, {})]
    report.projection = list(parts)
    return report


def test_a_partition_behind_that_running_projectors_do_not_move_is_stuck() -> None:
    old = NOW - STALL - timedelta(seconds=1)
    stuck = PartitionProjection("p.tasks", 0, 3, 5, old)
    never = PartitionProjection("p.tasks", 1, 0, 1, None)
    moving = PartitionProjection("p.tasks", 2, 3, 5, NOW - timedelta(seconds=5))
    done = PartitionProjection("p.tasks", 3, 5, 5, old)
    report = _report(1, stuck, never, moving, done)
    assert report.stuck() == [stuck, never]
    assert not report.healthy
    # With no projector running, records behind only wait for one: not a fault.
    idle = _report(0, stuck, never)
    assert idle.stuck() == [] and idle.healthy
