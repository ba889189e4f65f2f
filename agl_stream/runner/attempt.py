"""Running one attempt: the agent under its timeout and unresponsiveness watch, its spans
streamed to the spans topic and all on the broker before the attempt's outcome is known."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from aiokafka.structs import RecordMetadata
from opentelemetry import context as otel_context

from agl_stream.agent.api import LitAgent, NamedResources, Rollout
from agl_stream.agent.emit import emit_reward
from agl_stream.agent.tracing import AttemptRecorder, current_recorder, tracer
from agl_stream.bus.streams import Sender
from agl_stream.events import AttemptStatus, ErrorInfo, RolloutQueued
from agl_stream.events.spans import too_large_stand_in
from agl_stream.gateway.proxy import Gateway
from agl_stream.gateway.routes import attempt_event_url
from agl_stream.runner.lane import EventTooLarge
from agl_stream.runtime.redaction import NO_REDACTION, Redaction

log = logging.getLogger(__name__)

ATTEMPT_SPAN = "agl.attempt"
WATCH_INTERVAL = 0.05


@dataclass
class Outcome:
    status: AttemptStatus
    error: ErrorInfo | None
    reward: float | None
    span_count: int
    cancelled: bool = False  # stopped by a RolloutCancelled
    # The spans' sends, not waited for: the lane commits them no later than the attempt's
    # end queued after them (one transaction less per attempt); wait on them after that.
    spans_sent: list[asyncio.Future[RecordMetadata]] = field(default_factory=list)


@dataclass
class AttemptHandle:
    """What the runner can do to an attempt in flight."""

    cancel_requested: ErrorInfo | None = None
    agent_task: asyncio.Task[Any] | None = None

    def request_cancel(self, error: ErrorInfo) -> None:
        """Stop the agent now; the supervisor sees it end and reports the cancellation."""
        self.cancel_requested = error
        if self.agent_task is not None:
            self.agent_task.cancel()


def _error(exc: BaseException) -> ErrorInfo:
    return ErrorInfo(
        type=type(exc).__name__,
        message=str(exc) or type(exc).__name__,
        traceback="".join(traceback.format_exception(exc))[-8000:],
    )


async def execute(
    agent: LitAgent,
    task: RolloutQueued,
    rollout: Rollout,
    resources: NamedResources,
    publisher: Sender,
    handle: AttemptHandle,
    flush_seconds: float = 0.2,
    gateway: Gateway | None = None,
    redaction: Redaction = NO_REDACTION,
) -> Outcome:
    recorder = AttemptRecorder(task.rollout_id, rollout.attempt_id)
    route = None
    if gateway is not None:
        # The agent's LLM resources point at the gateway, which records into this recorder.
        key = secrets.token_urlsafe(24) if agent.keyed_gateway else None
        route, resources = gateway.open_attempt(recorder, resources, rollout.resources_id, key=key)
        event_url = attempt_event_url(gateway.url, task.rollout_id, rollout.attempt_id)
        rollout = dataclasses.replace(rollout, event_url=event_url, key=key)
    sent: list[asyncio.Future[RecordMetadata]] = []

    async def pump() -> None:
        spans = recorder.take(len(sent))
        for recorded in spans:
            span = redaction.span(recorded)  # before it leaves the process
            try:
                sent.append(await publisher.send("spans", span))
            except EventTooLarge as exc:  # e.g. an LLM call with a huge context
                log.warning("attempt %s: %s; a stand-in says so", rollout.attempt_id, exc)
                stand_in = too_large_stand_in(span, exc.size, exc.limit)
                sent.append(await publisher.send("spans", stand_in))

    async def call_agent() -> Any:
        current_recorder.set(recorder)
        attributes = {"agl.rollout_id": task.rollout_id, "agl.attempt_id": rollout.attempt_id}
        with tracer().start_as_current_span(ATTEMPT_SPAN, attributes=attributes):
            if route is not None:
                route.parent = otel_context.get_current()
            recorder.start_clocks()
            result = await agent.rollout_async(json.loads(task.input_json), resources, rollout)
            if isinstance(result, int | float) and not isinstance(result, bool):
                emit_reward(float(result))
            return result

    agent_task = asyncio.create_task(call_agent())
    handle.agent_task = agent_task
    try:
        status, error, cancelled = await _supervise(
            agent_task, task, recorder, handle, pump, flush_seconds
        )
    finally:
        if gateway is not None:
            # Calls still in flight end (or are cancelled and recorded as failed) first, so
            # the span count below includes every call the gateway saw for this attempt.
            await gateway.close_attempt(task.rollout_id, rollout.attempt_id)
    span_count = recorder.close()
    await pump()
    return Outcome(status, error, recorder.reward, span_count, cancelled, sent)


async def _supervise(
    agent_task: asyncio.Task[Any],
    task: RolloutQueued,
    recorder: AttemptRecorder,
    handle: AttemptHandle,
    pump: Any,
    flush_seconds: float,
) -> tuple[AttemptStatus, ErrorInfo | None, bool]:
    last_flush = time.monotonic()
    try:
        while True:
            # A cancel request cancels the agent task itself, so this wakes at once for it.
            if handle.cancel_requested is not None:
                await _stop(agent_task)
                return AttemptStatus.FAILED, handle.cancel_requested, True
            if agent_task.done():
                break
            await asyncio.wait({agent_task}, timeout=WATCH_INTERVAL)
            now = time.monotonic()
            if agent_task.done():
                continue  # finished or cancelled: decided at the top
            if now - last_flush >= flush_seconds:
                await pump()
                last_flush = now
            # The clocks run from when the agent started running (a sync agent: when its
            # thread picked it up), not from when this attempt began.
            started = recorder.running_since
            if started is None:
                continue
            if task.timeout_seconds is not None and now - started > task.timeout_seconds:
                await _stop(agent_task)
                message = f"the agent ran past the rollout's timeout of {task.timeout_seconds:g} s"
                return AttemptStatus.TIMEOUT, ErrorInfo(type="Timeout", message=message), False
            quiet = now - recorder.last_progress
            if task.unresponsive_seconds is not None and quiet > task.unresponsive_seconds:
                await _stop(agent_task)
                limit = task.unresponsive_seconds
                message = f"no progress (no span) for {quiet:.1f} s, more than {limit:g} s"
                return (
                    AttemptStatus.UNRESPONSIVE,
                    ErrorInfo(type="Unresponsive", message=message),
                    False,
                )
    except BaseException:
        # Handed back (cancelled), or its spans could not be sent (the lane failed): the
        # attempt is abandoned, not finished, and its agent must not run on unwatched.
        await _stop(agent_task)
        raise
    exc = agent_task.exception()
    if exc is not None:
        return AttemptStatus.FAILED, _error(exc), False
    return AttemptStatus.SUCCEEDED, None, False


async def _stop(agent_task: asyncio.Task[Any]) -> None:
    """Cancel the agent; a sync agent's thread cannot be stopped and is left to finish alone
    (AgentThreads logs it; its late spans are dropped and counted), so wait only briefly."""
    agent_task.cancel()
    await asyncio.wait({agent_task}, timeout=1.0)
