"""The database's tables, as SQLAlchemy metadata (migrations create them).

Two kinds of schema live in one database:

- `public` (control): `consumer_offsets` for consumers other than the projector, and
  `read_models`, the list of read-model schemas and which one queries read (the active one).
- one PostgreSQL schema per read model (`read_model_1`, ...): the projection's rows and the
  offsets of the topics that produced them. A replay builds a fresh one beside the live one
  and switches `read_models.active` when it has caught up; queries never stop.

Read-model tables are declared without a schema and bound to one at execution time with
`schema_translate_map` (see `read_model.bind`).
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Double,
    Index,
    Integer,
    MetaData,
    Table,
    Text,
    Uuid,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

metadata = MetaData()

# Where each consumer of the topics stands, written in the same transaction as the rows that
# consuming produced; a restarted consumer seeks here (DESIGN.md: projection is exactly-once
# in effect).
consumer_offsets = Table(
    "consumer_offsets",
    metadata,
    Column("consumer", Text, primary_key=True),
    Column("topic", Text, primary_key=True),
    Column("partition", Integer, primary_key=True),
    Column("next_offset", BigInteger, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

read_models = Table(
    "read_models",
    metadata,
    Column("name", Text, primary_key=True),
    Column("active", Boolean, nullable=False, server_default="false"),
    Column("state", Text, nullable=False),  # building | ready | active | retired
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("activated_at", DateTime(timezone=True)),
    Column("description", Text),
)

# ---- one read model (schema bound at execution time) ---------------------------------------

read_model_metadata = MetaData()

rollouts = Table(
    "rollouts",
    read_model_metadata,
    Column("rollout_id", Text, primary_key=True),
    Column("status", Text, nullable=False),
    Column("mode", Text),
    Column("input", JSONB),
    Column("resources_id", Text),  # the pin, if any
    Column("metadata", JSONB, nullable=False),
    Column("timeout_seconds", Double),
    Column("unresponsive_seconds", Double),
    Column("max_attempts", Integer),
    Column("retry_condition", ARRAY(Text)),
    Column("first_queued_at", DateTime(timezone=True)),
    Column("queued_attempt", Integer, nullable=False),
    Column("queued_at", DateTime(timezone=True)),
    Column("queued_event_id", Uuid),
    Column("cancel_requested_at", DateTime(timezone=True)),
    Column("cancel_reason", Text),
    Column("cancel_requested_by", Text),
    Column("cancel_event_id", Uuid),
    Column("finished_status", Text),
    Column("finished_at", DateTime(timezone=True)),
    Column("finished_attempt_id", Text),
    Column("finished_attempt_count", Integer),
    Column("finished_error", JSONB),
    Column("finished_event_id", Uuid),
    # derived from the above and the rollout's attempts
    Column("attempt_count", Integer, nullable=False),
    Column("latest_attempt_id", Text),
    Column("worker_id", Text),
    Column("attempt_resources_id", Text),
    Column("started_at", DateTime(timezone=True)),
    Column("reward", Double),
    Column("error", JSONB),
    Column("updated_at", DateTime(timezone=True), nullable=False),
)

attempts = Table(
    "attempts",
    read_model_metadata,
    Column("rollout_id", Text, primary_key=True),
    Column("attempt_id", Text, primary_key=True),
    Column("attempt_number", Integer, nullable=False),
    Column("status", Text, nullable=False),
    Column("worker_id", Text, nullable=False),
    Column("resources_id", Text),
    Column("task_offset", BigInteger),
    Column("started_at", DateTime(timezone=True)),
    Column("started_event_id", Uuid),
    Column("started_worker_id", Text),
    Column("finished_at", DateTime(timezone=True)),
    Column("finished_status", Text),
    Column("finished_worker_id", Text),
    Column("error", JSONB),
    Column("span_count", Integer),
    Column("reward", Double),
    Column("finished_event_id", Uuid),
)

spans = Table(
    "spans",
    read_model_metadata,
    Column("rollout_id", Text, primary_key=True),
    Column("attempt_id", Text, primary_key=True),
    Column("sequence", BigInteger, primary_key=True),
    Column("event_id", Uuid, nullable=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False),
    Column("trace_id", Text, nullable=False),
    Column("span_id", Text, nullable=False),
    Column("parent_span_id", Text),
    Column("name", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("start_time", DateTime(timezone=True), nullable=False),
    Column("end_time", DateTime(timezone=True), nullable=False),
    Column("start_time_unix_nano", BigInteger, nullable=False),
    Column("end_time_unix_nano", BigInteger, nullable=False),
    Column("status_code", Text, nullable=False),
    Column("status_description", Text),
    Column("attributes", JSONB, nullable=False),
    Column("events", JSONB, nullable=False),
    Column("links", JSONB, nullable=False),
    Column("resource", JSONB, nullable=False),
    Column("scope_name", Text),
)

resources = Table(
    "resources",
    read_model_metadata,
    Column("resources_id", Text, primary_key=True),
    Column("version", BigInteger, nullable=False),
    Column("resources", JSONB, nullable=False),
    Column("published_by", Text),
    Column("parent_resources_id", Text),
    Column("metadata", JSONB, nullable=False),
    Column("published_at", DateTime(timezone=True), nullable=False),
    Column("event_id", Uuid, nullable=False),
)

workers = Table(
    "workers",
    read_model_metadata,
    Column("worker_id", Text, primary_key=True),
    Column("role", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("hostname", Text, nullable=False),
    Column("pid", Integer, nullable=False),
    Column("current_rollouts", ARRAY(Text), nullable=False),
    Column("counts", JSONB, nullable=False),
    Column("interval_seconds", Double, nullable=False),
    Column("first_seen_at", DateTime(timezone=True), nullable=False),
    Column("last_heartbeat_at", DateTime(timezone=True), nullable=False),
    Column("event_id", Uuid, nullable=False),
)

# Rewards given from outside an attempt (RewardRecorded), one row per event; the rollout,
# attempt and LLM call they name join them to the rows above.
rewards = Table(
    "rewards",
    read_model_metadata,
    Column("rollout_id", Text, primary_key=True),
    Column("event_id", Uuid, primary_key=True),
    Column("attempt_id", Text),
    Column("span_id", Text),
    Column("name", Text, nullable=False),
    Column("value", Double, nullable=False),
    Column("source", Text),
    Column("metadata", JSONB, nullable=False),
    Column("given_at", DateTime(timezone=True), nullable=False),
)

# The Agent Lightning store facade's records (agl_stream.compat.agl), each as its highest revision:
# `body` holds {"record": <Agent Lightning's model as JSON>, ...the facade's own fields}.
agl_records = Table(
    "agl_records",
    read_model_metadata,
    Column("kind", Text, primary_key=True),  # rollout | attempt | worker | resources
    Column("rollout_id", Text, primary_key=True),  # '' for workers and resources
    Column("record_id", Text, primary_key=True),
    Column("revision", BigInteger, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("body", JSONB, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    Column("event_id", Uuid, nullable=False),
)

projector_offsets = Table(
    "projector_offsets",
    read_model_metadata,
    Column("topic", Text, primary_key=True),
    Column("partition", Integer, primary_key=True),
    Column("next_offset", BigInteger, nullable=False),
    Column("end_offset", BigInteger, nullable=False),  # the partition's end when last seen
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

Index("rollouts_status_queued", rollouts.c.status, rollouts.c.first_queued_at)
Index("rollouts_queued", rollouts.c.first_queued_at, rollouts.c.rollout_id)
Index("rollouts_updated", rollouts.c.updated_at)
Index("rollouts_worker", rollouts.c.worker_id)
Index("rollouts_metadata", rollouts.c.metadata, postgresql_using="gin")
Index("rollouts_resources", rollouts.c.attempt_resources_id)
Index("resources_version", resources.c.version.desc())
Index("rewards_given", rewards.c.given_at)
Index("rewards_name", rewards.c.name, rewards.c.given_at)
Index("agl_records_created", agl_records.c.kind, agl_records.c.created_at)
Index(
    "agl_records_queue",
    text("((body->>'queued_at')::double precision)"),
    agl_records.c.created_at,
    agl_records.c.record_id,
    postgresql_where=text("kind = 'rollout' AND body->>'queued_at' IS NOT NULL"),
)
Index(
    "agl_records_running",
    text("(body->'record'->>'status')"),
    agl_records.c.record_id,
    postgresql_where=text(
        "kind = 'rollout' AND (body->'record'->>'status') IN ('preparing', 'running')"
    ),
)
