"""Emitters: what an agent reports, recorded as spans of its attempt.

Reward spans are named `agl.reward`; their attribute `agl.reward` holds the primary value
and `agl.reward.primary` its name; each named dimension is `agl.reward.<name>`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from opentelemetry.trace import Status, StatusCode

from agl_stream.agent.spans import flatten
from agl_stream.agent.tracing import tracer
from agl_stream.rewards import AGL_REWARD

MESSAGE_SPAN = "agl.message"
OBJECT_SPAN = "agl.object"
EXCEPTION_SPAN = "agl.exception"
ANNOTATION_SPAN = "agl.annotation"


def emit_reward(value: float | Mapping[str, float], primary: str | None = None) -> float:
    """Record a reward: one number, or several named dimensions of which `primary` (or the
    only one) is the reward that training uses. Returns the primary value."""
    if isinstance(value, Mapping):
        if not value:
            raise ValueError("emit_reward needs at least one dimension")
        if primary is None:
            if len(value) != 1:
                raise ValueError(f"several reward dimensions {sorted(value)}: say which is primary")
            primary = next(iter(value))
        if primary not in value:
            raise ValueError(f"primary reward {primary!r} is not among {sorted(value)}")
        dimensions = {str(k): float(v) for k, v in value.items()}
    else:
        primary = primary or "reward"
        dimensions = {primary: float(value)}
    main = dimensions[primary]
    if not all(math.isfinite(v) for v in dimensions.values()):
        raise ValueError(f"rewards must be finite numbers, got {dimensions}")
    attributes: dict[str, Any] = {"agl.reward": main, "agl.reward.primary": primary}
    attributes.update({f"agl.reward.{k}": v for k, v in dimensions.items() if k != "reward"})
    # The attempt that records this span takes its value as its reward (AttemptRecorder).
    with tracer().start_as_current_span(AGL_REWARD, attributes=attributes):
        pass
    return main


def emit_message(message: str, **attributes: Any) -> None:
    """Record a free-text message."""
    with tracer().start_as_current_span(
        MESSAGE_SPAN, attributes={"agl.message": message, **flatten(attributes)}
    ):
        pass


def emit_object(obj: Any, name: str = "object") -> None:
    """Record any JSON-serialisable object."""
    encoded = json.dumps(obj, default=str, sort_keys=True)
    with tracer().start_as_current_span(
        OBJECT_SPAN, attributes={"agl.object.name": name, "agl.object.json": encoded}
    ):
        pass


def emit_exception(exc: BaseException) -> None:
    """Record an exception (with its traceback) without raising it."""
    with tracer().start_as_current_span(EXCEPTION_SPAN, record_exception=False) as span:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


def emit_annotation(annotation: Mapping[str, Any]) -> None:
    """Record key/values (nested dicts become dotted keys)."""
    with tracer().start_as_current_span(ANNOTATION_SPAN, attributes=flatten(annotation)):
        pass
