"""Alembic environment: runs on the connection agl_stream.db.migrate hands it."""

from alembic import context

from agl_stream.db.schema import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata)
with context.begin_transaction():
    context.run_migrations()
