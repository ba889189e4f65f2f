"""Consumer offsets stored beside the rows they produced.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "consumer_offsets",
        sa.Column("consumer", sa.Text, primary_key=True),
        sa.Column("topic", sa.Text, primary_key=True),
        sa.Column("partition", sa.Integer, primary_key=True),
        sa.Column("next_offset", sa.BigInteger, nullable=False),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
    )


def downgrade() -> None:
    op.drop_table("consumer_offsets")
