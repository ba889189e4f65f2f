"""Rewards given from outside an attempt: late feedback, labels, CI results."""

from __future__ import annotations

import math
from typing import ClassVar

from pydantic import Field, field_validator

from agl_stream.events.base import Event
from agl_stream.events.ids import Id
from agl_stream.events.spans import SpanId

DEFAULT_REWARD_NAME = "reward"


class RewardRecorded(Event):
    """A reward for a rollout (or one of its attempts, or one LLM call of it), given when it
    was known: it counts only after an attempt of its rollout in the rollouts partition."""

    key_field: ClassVar[str] = "rollout_id"

    rollout_id: Id
    attempt_id: Id | None = None
    span_id: SpanId | None = None
    name: str = Field(default=DEFAULT_REWARD_NAME, min_length=1, max_length=200)
    value: float
    source: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)

    @field_validator("value")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"a reward must be a finite number, got {value}")
        return value


__all__ = ["DEFAULT_REWARD_NAME", "RewardRecorded"]
