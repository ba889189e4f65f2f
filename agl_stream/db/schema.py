"""The read model's tables, as SQLAlchemy metadata (migrations create them)."""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, DateTime, Integer, MetaData, Table, Text, func

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
