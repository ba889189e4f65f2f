"""The projection: rollouts, attempts, spans, resources, workers, and the projector's offsets.

Revision ID: rm0001
Revises:
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

revision = "rm0001"
down_revision = None
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "rollouts",
        sa.Column("rollout_id", sa.Text, primary_key=True),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("mode", sa.Text),
        sa.Column("input", JSONB),
        sa.Column("resources_id", sa.Text),
        sa.Column("metadata", JSONB, nullable=False),
        sa.Column("timeout_seconds", sa.Double),
        sa.Column("unresponsive_seconds", sa.Double),
        sa.Column("max_attempts", sa.Integer),
        sa.Column("retry_condition", ARRAY(sa.Text)),
        sa.Column("first_queued_at", TS),
        sa.Column("queued_attempt", sa.Integer, nullable=False),
        sa.Column("queued_at", TS),
        sa.Column("queued_event_id", sa.Uuid),
        sa.Column("cancel_requested_at", TS),
        sa.Column("cancel_reason", sa.Text),
        sa.Column("cancel_requested_by", sa.Text),
        sa.Column("cancel_event_id", sa.Uuid),
        sa.Column("finished_status", sa.Text),
        sa.Column("finished_at", TS),
        sa.Column("finished_attempt_id", sa.Text),
        sa.Column("finished_attempt_count", sa.Integer),
        sa.Column("finished_error", JSONB),
        sa.Column("finished_event_id", sa.Uuid),
        sa.Column("attempt_count", sa.Integer, nullable=False),
        sa.Column("latest_attempt_id", sa.Text),
        sa.Column("worker_id", sa.Text),
        sa.Column("attempt_resources_id", sa.Text),
        sa.Column("started_at", TS),
        sa.Column("reward", sa.Double),
        sa.Column("error", JSONB),
        sa.Column("updated_at", TS, nullable=False),
    )
    op.create_index("rollouts_status_queued", "rollouts", ["status", "first_queued_at"])
    op.create_index("rollouts_queued", "rollouts", ["first_queued_at", "rollout_id"])
    op.create_index("rollouts_updated", "rollouts", ["updated_at"])
    op.create_index("rollouts_worker", "rollouts", ["worker_id"])
    op.create_index("rollouts_resources", "rollouts", ["attempt_resources_id"])
    op.create_index("rollouts_metadata", "rollouts", ["metadata"], postgresql_using="gin")
    op.create_table(
        "attempts",
        sa.Column("rollout_id", sa.Text, primary_key=True),
        sa.Column("attempt_id", sa.Text, primary_key=True),
        sa.Column("attempt_number", sa.Integer, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("worker_id", sa.Text, nullable=False),
        sa.Column("resources_id", sa.Text),
        sa.Column("task_offset", sa.BigInteger),
        sa.Column("started_at", TS),
        sa.Column("started_event_id", sa.Uuid),
        sa.Column("started_worker_id", sa.Text),
        sa.Column("finished_at", TS),
        sa.Column("finished_status", sa.Text),
        sa.Column("finished_worker_id", sa.Text),
        sa.Column("error", JSONB),
        sa.Column("span_count", sa.Integer),
        sa.Column("reward", sa.Double),
        sa.Column("finished_event_id", sa.Uuid),
    )
    op.create_table(
        "spans",
        sa.Column("rollout_id", sa.Text, primary_key=True),
        sa.Column("attempt_id", sa.Text, primary_key=True),
        sa.Column("sequence", sa.BigInteger, primary_key=True),
        sa.Column("event_id", sa.Uuid, nullable=False),
        sa.Column("recorded_at", TS, nullable=False),
        sa.Column("trace_id", sa.Text, nullable=False),
        sa.Column("span_id", sa.Text, nullable=False),
        sa.Column("parent_span_id", sa.Text),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("start_time", TS, nullable=False),
        sa.Column("end_time", TS, nullable=False),
        sa.Column("start_time_unix_nano", sa.BigInteger, nullable=False),
        sa.Column("end_time_unix_nano", sa.BigInteger, nullable=False),
        sa.Column("status_code", sa.Text, nullable=False),
        sa.Column("status_description", sa.Text),
        sa.Column("attributes", JSONB, nullable=False),
        sa.Column("events", JSONB, nullable=False),
        sa.Column("links", JSONB, nullable=False),
        sa.Column("resource", JSONB, nullable=False),
        sa.Column("scope_name", sa.Text),
    )
    op.create_table(
        "resources",
        sa.Column("resources_id", sa.Text, primary_key=True),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("resources", JSONB, nullable=False),
        sa.Column("published_by", sa.Text),
        sa.Column("parent_resources_id", sa.Text),
        sa.Column("metadata", JSONB, nullable=False),
        sa.Column("published_at", TS, nullable=False),
        sa.Column("event_id", sa.Uuid, nullable=False),
    )
    op.create_index("resources_version", "resources", [sa.text("version DESC")])
    op.create_table(
        "workers",
        sa.Column("worker_id", sa.Text, primary_key=True),
        sa.Column("role", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("hostname", sa.Text, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("current_rollouts", ARRAY(sa.Text), nullable=False),
        sa.Column("counts", JSONB, nullable=False),
        sa.Column("interval_seconds", sa.Double, nullable=False),
        sa.Column("first_seen_at", TS, nullable=False),
        sa.Column("last_heartbeat_at", TS, nullable=False),
        sa.Column("event_id", sa.Uuid, nullable=False),
    )
    op.create_table(
        "projector_offsets",
        sa.Column("topic", sa.Text, primary_key=True),
        sa.Column("partition", sa.Integer, primary_key=True),
        sa.Column("next_offset", sa.BigInteger, nullable=False),
        sa.Column("end_offset", sa.BigInteger, nullable=False),
        sa.Column("updated_at", TS, nullable=False, server_default=sa.func.now()),
    )


def downgrade() -> None:
    for table in ("projector_offsets", "workers", "resources", "spans", "attempts", "rollouts"):
        op.drop_table(table)
