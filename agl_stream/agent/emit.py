"""Emitters: what an agent reports, recorded as spans of its attempt.

Reward spans are named `agl.reward`; their attribute `agl.reward` holds the primary value
and `agl.reward.primary` its name; each named dimension is `agl.reward.<name>`.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from typing import Any

from opentelemetry.trace import Status, StatusCode

from agl_stream.agent.spans import flatten
from agl_stream.agent.tracing import current_recorder, tracer
from agl_stream.events.reward_rules import AGL_REWARD, REWARD_POLICY

log = logging.getLogger(__name__)
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}
_warned_level = False


def emitter_debug() -> bool:
    """AGL_EMITTER_DEBUG, as Agent Lightning reads it: on, each emitted span is logged (at
    DEBUG, with the attempt that records it or "no attempt"); unset, on when this module's
    logger is at DEBUG. A value that is no boolean stops with ValueError naming it."""
    global _warned_level
    raw = os.environ.get("AGL_EMITTER_DEBUG")
    if raw is None:
        return log.isEnabledFor(logging.DEBUG)
    value = raw.strip().lower()
    if value not in _TRUE | _FALSE:
        raise ValueError(f"AGL_EMITTER_DEBUG must be one of {sorted(_TRUE)} or {sorted(_FALSE)}")
    on = value in _TRUE
    if on and not log.isEnabledFor(logging.DEBUG) and not _warned_level:
        _warned_level = True
        log.warning("AGL_EMITTER_DEBUG is on but %s does not log at DEBUG: nothing shows", __name__)
    return on


def _debug(name: str, attributes: Mapping[str, Any]) -> None:
    if emitter_debug():
        recorder = current_recorder.get()
        owner = (
            "no attempt (the span is dropped)"
            if recorder is None
            else f"attempt {recorder.attempt_id} of {recorder.rollout_id}"
        )
        log.debug("emitted %s %s for %s", name, dict(attributes), owner)


MESSAGE_SPAN = "agl.message"
OBJECT_SPAN = "agl.object"
EXCEPTION_SPAN = "agl.exception"
ANNOTATION_SPAN = "agl.annotation"


def emit_reward(
    value: float | Mapping[str, float], primary: str | None = None, policy: str | None = None
) -> float:
    """Record a reward: one number, or several named dimensions of which `primary` (or the
    only one) is the reward that training uses. With `policy` (several policies trained
    together), it is that policy's reward alone: its trainer takes it instead of the
    attempt's, which it does not set. Returns the primary value."""
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
    if policy is not None:
        attributes[REWARD_POLICY] = policy
    # The attempt that records this span takes its value as its reward (AttemptRecorder).
    _debug(AGL_REWARD, attributes)
    with tracer().start_as_current_span(AGL_REWARD, attributes=attributes):
        pass
    return main


def emit_message(message: str, **attributes: Any) -> None:
    """Record a free-text message."""
    recorded = {"agl.message": message, **flatten(attributes)}
    _debug(MESSAGE_SPAN, recorded)
    with tracer().start_as_current_span(MESSAGE_SPAN, attributes=recorded):
        pass


def emit_object(obj: Any, name: str = "object") -> None:
    """Record any JSON-serialisable object."""
    encoded = json.dumps(obj, default=str, sort_keys=True)
    recorded = {"agl.object.name": name, "agl.object.json": encoded}
    _debug(OBJECT_SPAN, recorded)
    with tracer().start_as_current_span(OBJECT_SPAN, attributes=recorded):
        pass


def emit_exception(exc: BaseException) -> None:
    """Record an exception (with its traceback) without raising it."""
    _debug(EXCEPTION_SPAN, {"exception": f"{type(exc).__name__}: {exc}"})
    with tracer().start_as_current_span(EXCEPTION_SPAN, record_exception=False) as span:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


def emit_annotation(annotation: Mapping[str, Any]) -> None:
    """Record key/values (nested dicts become dotted keys)."""
    recorded = flatten(annotation)
    _debug(ANNOTATION_SPAN, recorded)
    with tracer().start_as_current_span(ANNOTATION_SPAN, attributes=recorded):
        pass
