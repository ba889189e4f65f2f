"""Which spans carry a reward, and its value. agl-stream's own emitter writes an `agl.reward`
span; agents written for Agent Lightning write its forms, read here the way Agent Lightning
0.3 reads them (`agentlightning.emitter.reward.get_reward_value`):

1. any span with `agentlightning.reward.<i>.name/value` attributes: the primary reward is the
   value at index 0 (what Agent Lightning's `emit_reward` writes, on an
   `agentlightning.annotation` span);
2. AgentOps' legacy form: `agentops.task.output` or `agentops.entity.output` holding
   `{"type": "reward", "value": x}` (a JSON string, as OpenTelemetry attributes are flat);
3. Agent Lightning 0.2's form: a span named `agentlightning.annotation` with a `reward`
   attribute.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

AGL_REWARD = "agl.reward"  # emit_reward's span; its attribute of the same name is the reward
AL_REWARD_PRIMARY = "agentlightning.reward.0.value"
# A reward given to one policy of the attempt (several policies trained together): that
# policy's trainer takes it instead of the attempt's reward; it is not the attempt's reward.
REWARD_POLICY = "agl.reward.policy"
AL_ANNOTATION = "agentlightning.annotation"
AGENTOPS_OUTPUTS = ("agentops.task.output", "agentops.entity.output")


def span_reward(name: str, attributes: Mapping[str, Any] | None) -> float | None:
    """The reward a span carries, or None when it carries none (or a value that is not a
    finite number)."""
    attributes = attributes or {}
    if name == AGL_REWARD:
        return _number(attributes.get(AGL_REWARD))
    if AL_REWARD_PRIMARY in attributes:
        return _number(attributes[AL_REWARD_PRIMARY])
    for key in AGENTOPS_OUTPUTS:
        output = _json_object(attributes.get(key))
        if output is not None and output.get("type") == "reward":
            return _number(output.get("value"))
    if name == AL_ANNOTATION:
        return _number(attributes.get("reward"))
    return None


def reward_policy(attributes: Mapping[str, Any] | None) -> str | None:
    """The policy a reward span names, if any."""
    named = (attributes or {}).get(REWARD_POLICY)
    return named if isinstance(named, str) and named else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _json_object(value: Any) -> Mapping[str, Any] | None:
    if isinstance(value, Mapping):
        return value
    if not isinstance(value, str):
        return None
    try:
        decoded = json.loads(value)
    except ValueError:
        return None
    return decoded if isinstance(decoded, Mapping) else None


# -- rewards given from outside an attempt (RewardRecorded) ------------------------------------

UNKNOWN_ROLLOUT = "unknown_rollout"
UNKNOWN_ATTEMPT = "unknown_attempt"
FUTURE_REWARD = "future_reward"
# How far ahead of the clock a reward's time may be (clocks drift; a reward from the far
# future would stay "the newest" for good).
MAX_CLOCK_SKEW = timedelta(minutes=5)


def record_time(timestamp_ms: int) -> datetime | None:
    """A record's broker timestamp as a time (None where it is out of datetime's range)."""
    try:
        return datetime.fromtimestamp(timestamp_ms / 1000, UTC)
    except (OverflowError, ValueError, OSError):
        return None


def given_at_problem(given_at: datetime, now: datetime) -> str | None:
    """Why a reward's time cannot be taken (no time zone, or later than `now` by more than
    clocks drift), or None."""
    if given_at.tzinfo is None:
        return "given_at needs a time zone (e.g. 2026-11-27T10:00:00Z)"
    if given_at > now + MAX_CLOCK_SKEW:
        return (
            f"given_at {given_at.isoformat()} is in the future (now is {now.isoformat()}; "
            f"a reward may be at most {int(MAX_CLOCK_SKEW.total_seconds() // 60)} minutes ahead)"
        )
    return None


def late_reward_refusal(
    rollout_id: str,
    attempt_id: str | None,
    attempts_before: Collection[str],
    given_at: datetime | None = None,
    recorded_at: datetime | None = None,
) -> tuple[str, str] | None:
    """Why a RewardRecorded does not count, as (dead-letter kind, reason), or None when it does.

    The rule every consumer applies, decided by one partition's order alone (so the same in
    any interleaving across topics, and in a replay): a reward counts when an AttemptStarted
    or AttemptFinished of its rollout, and of the attempt it names if it names one, lies
    before it in its partition of the rollouts topic. `attempts_before` are the ids of those
    attempts. Given the reward's time and its record's (the broker's timestamp), a reward
    given later than its record was written, by more than clocks drift, does not count
    either."""
    if given_at is not None and recorded_at is not None:
        problem = given_at_problem(given_at, recorded_at)
        if problem is not None:
            return FUTURE_REWARD, (
                f"a reward for rollout {rollout_id!r} whose time is past its record's: "
                + problem.replace("now is", "its record was written at")
            )
    if not attempts_before:
        return UNKNOWN_ROLLOUT, (
            f"a reward for rollout {rollout_id!r}, which has no attempt before it on its "
            "rollouts partition (unknown rollout: rewards count only after an AttemptStarted "
            "or AttemptFinished of their rollout)"
        )
    if attempt_id is not None and attempt_id not in attempts_before:
        return UNKNOWN_ATTEMPT, (
            f"a reward for attempt {attempt_id!r} of rollout {rollout_id!r}, which has no "
            "such attempt before it on its rollouts partition (unknown attempt)"
        )
    return None
