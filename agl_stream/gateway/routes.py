"""Where a call comes from, read off its URL: the runner hands each attempt a base URL of its
own (`.../rollouts/<rollout>/attempts/<attempt>/<resource>/v1`), so any client that takes a
base URL tells the gateway which attempt and which LLM resource it is calling for."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote, unquote

from agl_stream.gateway.wire import CallKind

ENDPOINTS = {"chat/completions": CallKind.CHAT, "completions": CallKind.COMPLETION}
RESOURCES_HEADER = "X-AGL-Resources-Id"  # the policy server says which version answered


@dataclass(frozen=True)
class Identity:
    rollout_id: str
    attempt_id: str
    resource: str


def attempt_base_url(gateway_url: str, identity: Identity) -> str:
    """The OpenAI base URL an attempt's agent is given for one LLM resource."""
    parts = (identity.rollout_id, identity.attempt_id, identity.resource)
    rollout, attempt, resource = (quote(p, safe="") for p in parts)
    return f"{gateway_url.rstrip('/')}/rollouts/{rollout}/attempts/{attempt}/{resource}/v1"


def attempt_event_url(gateway_url: str, rollout_id: str, attempt_id: str) -> str:
    """Where an attempt's agent POSTs its events (rewards, messages, spans)."""
    rollout, attempt = quote(rollout_id, safe=""), quote(attempt_id, safe="")
    return f"{gateway_url.rstrip('/')}/rollouts/{rollout}/attempts/{attempt}/events"


def parse_path(path: str) -> tuple[Identity | None, str]:
    """(identity or None, the path after /v1/): `/v1/chat/completions` has no identity;
    `/rollouts/R/attempts/A/NAME/v1/completions` has one. ValueError for anything else."""
    parts = path.strip("/").split("/")
    if parts[:1] == ["v1"]:
        return None, "/".join(parts[1:])
    if len(parts) >= 6 and parts[0] == "rollouts" and parts[2] == "attempts" and parts[5] == "v1":
        identity = Identity(unquote(parts[1]), unquote(parts[3]), unquote(parts[4]))
        return identity, "/".join(parts[6:])
    raise ValueError(
        f"{path!r} is not an OpenAI path of this gateway "
        "(expected /v1/... or /rollouts/<rollout>/attempts/<attempt>/<resource>/v1/...)"
    )


def upstream_url(base: str, endpoint: str) -> str:
    """An upstream base URL (`http://host:8000/v1`) joined with an endpoint path."""
    return f"{base.rstrip('/')}/{endpoint}"
