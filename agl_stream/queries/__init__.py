"""Queries over the read model: `ReadModel` (async API) and its result types."""

from agl_stream.queries.models import (
    Attempt,
    Page,
    PartitionLag,
    Resources,
    Rollout,
    Span,
    Worker,
)
from agl_stream.queries.params import NotFound, QueryError, RolloutFilter
from agl_stream.queries.read_model import ReadModel

__all__ = [
    "Attempt",
    "NotFound",
    "Page",
    "PartitionLag",
    "QueryError",
    "ReadModel",
    "Resources",
    "Rollout",
    "RolloutFilter",
    "Span",
    "Worker",
]
