"""What a process agent POSTs to its attempt's event URL (`AGL_EVENT_URL`), read into events
that are recorded as spans of the attempt. The body is one JSON object or a list of them; each
names its kind in `type` (or `event_type`), with its fields beside it or under `data`:

    {"type": "reward", "value": 0.8}
    {"type": "reward", "value": {"accuracy": 1.0, "length": 0.3}, "primary": "accuracy"}
    {"type": "message", "message": "looked up the weather"}
    {"type": "object", "name": "answer", "value": {"city": "Paris"}}
    {"type": "annotation", "attributes": {"tool": "search", "hits": 3}}
    {"type": "span", "name": "tool.search", "attributes": {"query": "paris"}}

Parsing is pure: `parse_events` raises `BadEvents` naming the first problem, and nothing of a
body with a problem is recorded.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agl_stream.agent.emit import emit_annotation, emit_message, emit_object, emit_reward
from agl_stream.agent.spans import flatten
from agl_stream.agent.tracing import tracer

KINDS = ("reward", "message", "object", "annotation", "span")
MAX_EVENTS = 1000  # per request


class BadEvents(ValueError):
    """A body of events that cannot be recorded; the message says what is wrong."""


@dataclass(frozen=True)
class AgentEvent:
    kind: str
    fields: Mapping[str, Any]

    def record(self) -> None:
        """Record this event as a span of the current attempt (the caller sets it)."""
        f = self.fields
        if self.kind == "reward":
            emit_reward(f["value"], f.get("primary"))
        elif self.kind == "message":
            emit_message(f["message"])
        elif self.kind == "object":
            emit_object(f["value"], f.get("name", "object"))
        elif self.kind == "annotation":
            emit_annotation(f["attributes"])
        else:
            attributes = flatten(f.get("attributes") or {})
            with tracer().start_as_current_span(f["name"], attributes=attributes):
                pass


def parse_events(raw: bytes) -> list[AgentEvent]:
    try:
        body = json.loads(raw or b"null")
    except ValueError as exc:
        raise BadEvents(f"the body is not JSON: {exc}") from None
    items = body if isinstance(body, list) else [body]
    if not items:
        raise BadEvents("the body is an empty list: send at least one event")
    if len(items) > MAX_EVENTS:
        raise BadEvents(f"{len(items)} events in one request; at most {MAX_EVENTS}")
    return [_event(i, item) for i, item in enumerate(items)]


def _event(index: int, item: Any) -> AgentEvent:
    where = f"event {index}"
    if not isinstance(item, dict):
        raise BadEvents(f"{where} is not a JSON object")
    kind = item.get("type", item.get("event_type"))
    if kind not in KINDS:
        raise BadEvents(f"{where}: type {kind!r} is not one of {', '.join(KINDS)}")
    data = item.get("data")
    fields = {**item, **data} if isinstance(data, dict) else dict(item)
    _check(where, kind, fields)
    return AgentEvent(kind, fields)


def _check(where: str, kind: str, f: Mapping[str, Any]) -> None:
    if kind == "reward":
        value = f.get("value")
        if isinstance(value, dict):
            valid = bool(value) and all(_finite(v) for v in value.values())
        else:
            valid = _finite(value)
        if not valid:
            raise BadEvents(
                f"{where}: a reward's value must be a finite number or an object of them"
            )
        primary = f.get("primary")
        if isinstance(value, dict) and len(value) > 1 and primary not in value:
            raise BadEvents(
                f"{where}: several reward dimensions {sorted(value)}: say which is primary"
            )
    elif kind == "message" and not isinstance(f.get("message"), str):
        raise BadEvents(f"{where}: a message needs a string 'message'")
    elif kind == "object" and "value" not in f:
        raise BadEvents(f"{where}: an object needs a 'value'")
    elif kind == "annotation" and not isinstance(f.get("attributes"), dict):
        raise BadEvents(f"{where}: an annotation needs an object 'attributes'")
    elif kind == "span":
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise BadEvents(f"{where}: a span needs a non-empty string 'name'")
        if not isinstance(f.get("attributes", {}), dict):
            raise BadEvents(f"{where}: a span's 'attributes' must be an object")


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
