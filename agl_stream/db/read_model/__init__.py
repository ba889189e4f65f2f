"""Alembic chain of one read model schema (see env.py)."""
