"""Rewards given from outside an attempt (RewardRecorded), joined to rollouts by id.

Revision ID: rm0002
Revises: rm0001
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "rm0002"
down_revision = "rm0001"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "rewards",
        sa.Column("rollout_id", sa.Text, primary_key=True),
        sa.Column("event_id", sa.Uuid, primary_key=True),
        sa.Column("attempt_id", sa.Text),
        sa.Column("span_id", sa.Text),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("value", sa.Double, nullable=False),
        sa.Column("source", sa.Text),
        sa.Column("metadata", JSONB, nullable=False),
        sa.Column("given_at", TS, nullable=False),
    )
    op.create_index("rewards_given", "rewards", ["given_at"])
    op.create_index("rewards_name", "rewards", ["name", "given_at"])


def downgrade() -> None:
    op.drop_table("rewards")
