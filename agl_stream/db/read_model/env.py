"""Alembic environment of one read-model schema: its tables and its version table live in
the schema named by config.attributes["schema"]."""

from alembic import context
from sqlalchemy import text

from agl_stream.db.schema import read_model_metadata

connection = context.config.attributes["connection"]
schema = context.config.attributes["schema"]
connection.execute(text(f'SET LOCAL search_path TO "{schema}"'))
context.configure(
    connection=connection,
    target_metadata=read_model_metadata,
    version_table_schema=schema,
)
with context.begin_transaction():
    context.run_migrations()
