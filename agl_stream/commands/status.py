"""What `agl-stream status` reports: broker, topics and their end offsets, consumer groups
and their lag, the database, and how far the projection is behind each partition (a
partition a running projector does not move is a fault: `healthy` is false)."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import asyncpg
from aiokafka import TopicPartition

from agl_stream.bus.kafka import admin_client, consumer, end_offsets, retrying
from agl_stream.bus.roles import load_roles
from agl_stream.bus.topic_spec import load_topic_specs
from agl_stream.db.migrate import head_revision
from agl_stream.db.problems import database_problem
from agl_stream.projection.projector import PROJECTED_TOPICS, projector_group
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings


@dataclass(frozen=True)
class TopicStatus:
    name: str
    partitions: int
    end_offsets: tuple[int, ...]

    @property
    def records(self) -> int:
        return sum(self.end_offsets)


@dataclass(frozen=True)
class GroupStatus:
    group: str
    state: str
    members: int
    lag: dict[str, int]  # topic -> records behind, summed over its partitions


@dataclass(frozen=True)
class DatabaseStatus:
    reachable: bool
    detail: str
    revision: str | None = None
    head: str | None = None


# A partition behind its end that a running projector has not moved for this long is stuck.
STALL = timedelta(minutes=2)


@dataclass(frozen=True)
class PartitionProjection:
    """Where the read model stands on one partition of a projected topic."""

    topic: str
    partition: int
    projected_to: int  # the next offset the read model will take (0: none taken yet)
    end: int
    updated_at: datetime | None  # when the projection last moved here (None: never)

    @property
    def lag(self) -> int:
        return max(0, self.end - self.projected_to)

    def stalled(self, now: datetime) -> bool:
        return self.lag > 0 and (self.updated_at is None or now - self.updated_at > STALL)


@dataclass
class StatusReport:
    bootstrap_servers: str
    broker_reachable: bool
    broker_detail: str = ""
    broker: str = ""  # what the broker is: "Apache Kafka 4.1.1 (embedded ...)" or the cluster
    topics: list[TopicStatus] = field(default_factory=list)
    missing_topics: list[str] = field(default_factory=list)
    groups: list[GroupStatus] = field(default_factory=list)
    database: DatabaseStatus | None = None
    projection: list[PartitionProjection] = field(default_factory=list)
    projector_group: str = ""
    checked_at: datetime = field(default_factory=lambda: datetime.now(UTC))

    @property
    def projectors(self) -> int:
        """Members of the projectors' group now."""
        return sum(g.members for g in self.groups if g.group == self.projector_group)

    def stuck(self) -> list[PartitionProjection]:
        """Partitions behind their end that projectors, running, have not moved for STALL
        (with none running, a partition behind is only waiting for one)."""
        if not self.projectors:
            return []
        return [p for p in self.projection if p.stalled(self.checked_at)]

    @property
    def healthy(self) -> bool:
        db_ok = self.database is None or self.database.reachable
        return self.broker_reachable and not self.missing_topics and db_ok and not self.stuck()


async def collect(
    kafka: KafkaSettings, database: DatabaseSettings | None, embedded: str | None = None
) -> StatusReport:
    """`embedded`: how to name the broker when it is the embedded stack's (Kafka does not
    say its own version on the wire)."""
    report = StatusReport(
        kafka.bootstrap_servers, broker_reachable=False,
        projector_group=projector_group(kafka.topic_prefix),
    )  # fmt: skip
    db_task = asyncio.create_task(_database(database)) if database else None
    try:
        await _broker(kafka, report, embedded)
    except Exception as exc:  # noqa: BLE001 - any failure means "unreachable", said plainly
        report.broker_detail = f"{type(exc).__name__}: {exc}"
    if db_task is not None:
        report.database, stored = await db_task
        report.projection = projection_status(report.topics, stored, PROJECTED_TOPICS, kafka)
    return report


def projection_status(
    topics: list[TopicStatus],
    stored: dict[tuple[str, int], tuple[int, datetime]],
    projected: tuple[str, ...],
    kafka: KafkaSettings,
) -> list[PartitionProjection]:
    """Every partition of the projected topics against what the read model stored for it
    (`stored`: next offset and when it moved, per partition); one it never stored is at 0."""
    specs = load_topic_specs()
    names = {specs[short].full_name(kafka.topic_prefix) for short in projected}
    out = []
    for topic in topics:
        if topic.name not in names:
            continue
        for partition, end in enumerate(topic.end_offsets):
            at, moved = stored.get((topic.name, partition), (0, None))
            out.append(PartitionProjection(topic.name, partition, at, end, moved))
    return out


async def _broker(kafka: KafkaSettings, report: StatusReport, embedded: str | None) -> None:
    specs = load_topic_specs()
    wanted = [s.full_name(kafka.topic_prefix) for s in specs.values()]
    async with admin_client(kafka) as admin:
        existing = set(await admin.list_topics())
        report.broker_reachable = True
        cluster = await admin.describe_cluster()
        count = len(cluster["brokers"])
        shape = f"cluster {cluster['cluster_id']}, {count} broker{'s' if count != 1 else ''}"
        report.broker = f"{embedded}; {shape}" if embedded else f"Kafka {shape}"
        present = [name for name in wanted if name in existing]
        report.missing_topics = [name for name in wanted if name not in existing]
        described = await admin.describe_topics(present) if present else []
        groups = await admin.list_consumer_groups()
        # Enqueue markers (agl_stream/commands/enqueue.py) are groups no consumer is in: not listed.
        candidates = sorted(g[0] for g in groups if not is_enqueue_marker(g[0]))
        # This deployment's groups: its roles' (even before they commit) and any other that
        # committed on its topics; a cluster shared by other prefixes lists many more. One
        # offset fetch a group on the admin's connection (a consumer a group took seconds).
        on = set(present)
        ours = {spec.group_id(kafka.topic_prefix) for spec in load_roles().values()}
        commits: dict[str, dict[TopicPartition, int]] = {}
        for group_id in candidates:
            # (a group the broker is still loading answers "no coordinator" for a moment)
            fetched = await retrying(
                functools.partial(admin.list_consumer_group_offsets, group_id),
                f"reading the offsets of {group_id}",
                within=15.0,
            )
            mine = {tp: o.offset for tp, o in fetched.items() if tp.topic in on and o.offset >= 0}
            if mine or group_id in ours:
                commits[group_id] = mine
        # One group per request: aiokafka 0.14 misreads a DescribeGroups answer from Kafka
        # 4 that holds several groups (the second is read from the wrong offset).
        descriptions = [await admin.describe_consumer_groups([g]) for g in commits]
    partitions = {t["topic"]: len(t["partitions"]) for t in described}
    tps = [TopicPartition(name, p) for name, n in partitions.items() for p in range(n)]
    ends = await end_offsets(kafka, tps)
    starts = await _beginning_offsets(kafka, tps) if commits and tps else {}
    for name in present:
        offsets = tuple(ends.get(TopicPartition(name, p), 0) for p in range(partitions[name]))
        report.topics.append(TopicStatus(name, partitions[name], offsets))
    states = {}
    for responses in descriptions:
        for response in responses:
            for group in response.groups:
                states[group[1]] = (group[2], len(group[5]))
    for group_id, committed in commits.items():
        lag = group_lag({tp: committed.get(tp) for tp in tps}, starts, ends)
        state, members = states.get(group_id, ("unknown", 0))
        report.groups.append(GroupStatus(group_id, state, members, lag))


def is_enqueue_marker(group_id: str) -> bool:
    """A group that only records how far a keyed enqueue got (`<prefix>enqueue-<digest>`)."""
    _, found, digest = group_id.rpartition("enqueue-")
    return bool(found) and len(digest) == 16 and all(c in "0123456789abcdef" for c in digest)


async def _beginning_offsets(
    kafka: KafkaSettings, tps: list[TopicPartition]
) -> dict[TopicPartition, int]:
    async with consumer(kafka) as client:
        starts: dict[TopicPartition, int] = await client.beginning_offsets(tps)
        return starts


def group_lag(
    committed: dict[TopicPartition, int | None],
    starts: dict[TopicPartition, int],
    ends: dict[TopicPartition, int],
) -> dict[str, int]:
    """Records behind per topic, for the topics the group has committed on at all; a
    partition of such a topic with no commit yet is behind by everything it holds."""
    consumed = {tp.topic for tp, offset in committed.items() if offset is not None}
    lag: dict[str, int] = {}
    for tp, offset in committed.items():
        if tp.topic in consumed:
            position = offset if offset is not None else starts.get(tp, 0)
            lag[tp.topic] = lag.get(tp.topic, 0) + max(ends.get(tp, 0) - position, 0)
    return lag


Stored = dict[tuple[str, int], tuple[int, datetime]]


async def _database(settings: DatabaseSettings) -> tuple[DatabaseStatus, Stored]:
    """The database's state, and the active read model's offsets (none where it has none)."""
    try:
        conn = await asyncpg.connect(settings.asyncpg_dsn, timeout=5)
    except Exception as exc:  # noqa: BLE001 - said as a sentence where it can be
        detail = database_problem(exc) or f"{type(exc).__name__}: {exc}"
        return DatabaseStatus(False, detail, head=head_revision()), {}
    try:
        version = await conn.fetchval("SHOW server_version")
        has_table = await conn.fetchval("SELECT to_regclass('alembic_version') IS NOT NULL")
        revision = (
            await conn.fetchval("SELECT version_num FROM alembic_version") if has_table else None
        )
        status = DatabaseStatus(True, f"PostgreSQL {version}", revision, head_revision())
        return status, await _stored_offsets(conn)
    finally:
        await conn.close()


async def _stored_offsets(conn: asyncpg.Connection) -> Stored:
    if not await conn.fetchval("SELECT to_regclass('public.read_models') IS NOT NULL"):
        return {}
    schema = await conn.fetchval("SELECT name FROM public.read_models WHERE active")
    if schema is None:
        return {}
    rows = await conn.fetch(
        "SELECT topic, partition, next_offset, updated_at FROM "
        f"{quote_identifier(schema)}.projector_offsets"
    )
    return {(r["topic"], r["partition"]): (r["next_offset"], r["updated_at"]) for r in rows}


def quote_identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'
