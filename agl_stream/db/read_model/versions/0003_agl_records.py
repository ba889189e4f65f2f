"""The Agent Lightning store facade's records (agl_stream.compat.agl).

Revision ID: rm0003
Revises: rm0002
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "rm0003"
down_revision = "rm0002"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "agl_records",
        sa.Column("kind", sa.Text, primary_key=True),
        sa.Column("rollout_id", sa.Text, primary_key=True),
        sa.Column("record_id", sa.Text, primary_key=True),
        sa.Column("revision", sa.BigInteger, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("body", JSONB, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("event_id", sa.Uuid, nullable=False),
    )
    op.create_index("agl_records_created", "agl_records", ["kind", "created_at"])
    # The queue (dequeue's FIFO) and the running rollouts (the watchdog, before every call):
    # small partial indexes, so neither reads every rollout the store ever had.
    op.create_index(
        "agl_records_queue",
        "agl_records",
        [sa.text("((body->>'queued_at')::double precision)"), "created_at", "record_id"],
        postgresql_where=sa.text("kind = 'rollout' AND body->>'queued_at' IS NOT NULL"),
    )
    op.create_index(
        "agl_records_running",
        "agl_records",
        [sa.text("(body->'record'->>'status')"), "record_id"],
        postgresql_where=sa.text(
            "kind = 'rollout' AND (body->'record'->>'status') IN ('preparing', 'running')"
        ),
    )


def downgrade() -> None:
    op.drop_table("agl_records")
