"""The list of read-model schemas and which one is active.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "read_models",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("active", sa.Boolean, nullable=False, server_default="false"),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.Column("activated_at", sa.DateTime(timezone=True)),
        sa.Column("description", sa.Text),
    )
    # At most one read model is the one queries read.
    op.create_index(
        "read_models_one_active", "read_models", ["active"], unique=True,
        postgresql_where=sa.text("active"),
    )  # fmt: skip


def downgrade() -> None:
    op.drop_table("read_models")
