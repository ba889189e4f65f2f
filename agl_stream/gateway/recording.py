"""Who a gateway call is recorded for: a running attempt (its recorder numbers the span in the
attempt's sequence, so the terminal event's span count includes it) or, for calls with no
attempt, the gateway's own log of unattributed calls."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan

from agl_stream.agent.spans import to_event
from agl_stream.agent.tracing import AttemptRecorder
from agl_stream.events import LLM, Checkpoint, SpanRecorded

# The rollout id of calls that reached a gateway without an attempt's URL.
UNATTRIBUTED = "unattributed"


@dataclass
class AttemptRoute:
    """A running attempt as the gateway knows it: where its LLM resources point upstream,
    whom to record for, and the calls it has in flight."""

    recorder: AttemptRecorder
    upstreams: Mapping[str, str]  # LLM resource name -> upstream base URL
    resources_id: str | None
    parent: Context | None = None
    calls: set[asyncio.Task[object]] = field(default_factory=set)
    # A bearer token the attempt's URLs require (a process agent's AGL_KEY); None: open.
    key: str | None = None
    # Headers every answer on this route carries (a gateway session's rollout and attempt).
    answer_headers: Mapping[str, str] = field(default_factory=dict)
    # Several policies: policy name -> the upstream serving it, and LLM resource name -> the
    # policy it serves (policy_routes says which).
    policies: Mapping[str, str] = field(default_factory=dict)
    served: Mapping[str, str] = field(default_factory=dict)

    def policy_of(self, resource: str, model: object) -> str | None:
        """The policy a call names: the model it asks for when that is one of the attempt's
        policies, else the one its LLM resource serves (None: no policy, the default)."""
        if isinstance(model, str) and model in self.policies:
            return model
        return self.served.get(resource)

    async def drain(self, grace_seconds: float) -> None:
        """Wait for calls in flight to end; cancel those still running after the grace (each
        records itself as failed), so the recorder can be closed with an exact count."""
        pending = {t for t in self.calls if not t.done()}
        if not pending:
            return
        _, late = await asyncio.wait(pending, timeout=grace_seconds)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late, timeout=grace_seconds)


def policy_routes(resources: Mapping[str, object]) -> tuple[dict[str, str], dict[str, str]]:
    """With several policies, an attempt's version holds a Checkpoint resource per policy and
    an LLM resource serving each, whose model is the policy's name: (policy name -> that
    LLM's endpoint, LLM resource name -> policy name)."""
    policies = {name for name, r in resources.items() if isinstance(r, Checkpoint)}
    llms = {n: r for n, r in resources.items() if isinstance(r, LLM) and r.model in policies}
    endpoints: dict[str, str] = {}
    for llm in llms.values():
        endpoints.setdefault(llm.model, llm.endpoint)
    return endpoints, {name: llm.model for name, llm in llms.items()}


def call_log_id() -> str:
    """The attempt id a gateway records calls with no attempt under: its host and pid (to find
    it), when it started and a random part. The read model keeps one span per (rollout,
    attempt, sequence) and every gateway numbers its calls from 0, so an id that a restart
    could give again (a container keeps its hostname, and its pid is 1 again) had the new
    process's spans dropped as duplicates of the old one's."""
    started = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    return f"gateway-{socket.gethostname()}-{os.getpid()}-{started}-{secrets.token_hex(3)}"


class CallLog(AttemptRecorder):
    """Calls that carry no attempt: one open-ended 'attempt' per gateway started (rollout
    UNATTRIBUTED, attempt `call_log_id()`), numbered from 0, handed out in batches to send."""

    def __init__(self) -> None:
        super().__init__(UNATTRIBUTED, call_log_id())
        self._next = 0

    def record(self, span: ReadableSpan) -> bool:
        with self._lock:
            self._events.append(to_event(span, self.rollout_id, self.attempt_id, self._next))
            self._next += 1
            return True

    def drain(self) -> list[SpanRecorded]:
        with self._lock:
            events, self._events = self._events, []
            return events

    def put_back(self, events: list[SpanRecorded]) -> None:
        """A batch that could not be sent goes back to the front, in order."""
        with self._lock:
            self._events[:0] = events

    def waiting(self) -> int:
        with self._lock:
            return len(self._events)
