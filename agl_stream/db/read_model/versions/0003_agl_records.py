"""The Agent Lightning store facade's records (agl_stream.agl).

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


def downgrade() -> None:
    op.drop_table("agl_records")
