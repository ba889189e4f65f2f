"""Gateway sessions: the calls an application sends through `agl-stream gateway` with a
session key in a header become one rollout (one attempt) each, so production traffic is
trained on like runners' rollouts, joined with the rewards given later.

A session starts with its first call: the gateway publishes the attempt's AttemptStarted
(rollout `<prefix><key>`, its task the first call's request; no RolloutQueued, which would
send runners to run it) and waits for the broker before forwarding, so a reward given after
the answer always lies after it on the rollouts partition. Each call is an `agl.llm.call`
span of the attempt. It ends at a call carrying the end header, after `idle_seconds` without
calls, or when the gateway stops: its spans are sent, then AttemptFinished (succeeded, with
the span count) and RolloutFinished. Answers carry the rollout, attempt and call span ids in
headers (for `agl-stream reward --attempt --call`). A gateway killed mid-session loses the
session's unsent spans and cannot end it: another gateway ends it, unresponsive with the
reason (agl_stream.otlp.idle's SESSIONS_LOST), and the trainer does not train on it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from aiokafka.errors import MessageSizeTooLargeError

from agl_stream.agent.tracing import AttemptRecorder
from agl_stream.bus.streams import EventPublisher
from agl_stream.events import (
    AttemptFinished,
    AttemptStarted,
    AttemptStatus,
    AttemptTask,
    RolloutFinished,
    RolloutMode,
    RolloutStatus,
)
from agl_stream.gateway.recording import AttemptRoute, call_log_id
from agl_stream.runtime.http_errors import unexpected

log = logging.getLogger(__name__)

SESSION_HEADER = "X-AGL-Session"
SESSION_END_HEADER = "X-AGL-Session-End"
ROLLOUT_HEADER = "X-AGL-Rollout-Id"
ATTEMPT_HEADER = "X-AGL-Attempt-Id"
CALL_HEADER = "X-AGL-Call-Id"  # the call's span id
MAX_KEY = 200
REMEMBERED_ENDED = 100_000  # ended keys refused again, at most (the oldest are forgotten)


class SessionRefused(ValueError):
    """A session key or call the gateway cannot take; the message says why (a 400 or 409)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class SessionConfig:
    header: str = SESSION_HEADER
    prefix: str = "session-"  # rollout id = prefix + key
    idle_seconds: float = 300.0
    mode: RolloutMode = RolloutMode.TRAIN
    resources_id: str | None = None  # the version the upstream serves, if known


@dataclass
class Session:
    key: str
    route: AttemptRoute
    started: AttemptStarted
    sent: int = 0  # spans on the broker
    last_call: float = field(default_factory=time.monotonic)
    ending: bool = False


def session_task(body: dict[str, Any]) -> str:
    """The task a session is trained as: its first call's request without sampling options
    (what the application asked), so sessions that asked the same thing form a group."""
    asked = {k: body[k] for k in ("messages", "prompt") if k in body}
    return json.dumps(asked, sort_keys=True)


class Sessions:
    """The open sessions of one gateway, and their events."""

    def __init__(self, publisher: EventPublisher, config: SessionConfig) -> None:
        self.publisher = publisher
        self.config = config
        self.worker_id = call_log_id().replace("gateway-", "gateway-sessions-", 1)
        self.open: dict[str, Session] = {}
        # Keys this process ended (a key names one session), the most recent ones.
        self.ended: OrderedDict[str, None] = OrderedDict()
        self.counts: dict[str, int] = {"sessions_started": 0, "sessions_ended": 0}
        self._starting: dict[str, asyncio.Future[Session]] = {}

    def rollout_id(self, key: str) -> str:
        return f"{self.config.prefix}{key}"

    async def route(self, key: str, body: dict[str, Any]) -> Session:
        """The session of `key`, started (on the broker) if this is its first call."""
        if not key or len(key) > MAX_KEY or not key.isprintable():
            raise SessionRefused(
                f"a session key ({self.config.header}) must be 1-{MAX_KEY} printable characters"
            )
        session = self.open.get(key)
        if session is not None and not session.ending:
            session.last_call = time.monotonic()
            return session
        if session is not None or key in self.ended:
            raise SessionRefused(
                f"session {key!r} has ended (rollout {self.rollout_id(key)}); "
                "start a new conversation with a new key",
                409,
            )
        starting = self._starting.get(key)
        if starting is not None:  # its first call is still putting it on the broker
            return await asyncio.shield(starting)
        starting = self._starting[key] = asyncio.get_running_loop().create_future()
        try:
            session = await self._start(key, body)
        except Exception as exc:  # the broker refused: said to the caller
            refused = _start_refused(key, exc)
            starting.set_exception(refused)  # the calls waiting on it get it too
            starting.exception()  # (retrieved: only the waiters raise it)
            raise refused from exc
        except BaseException:
            starting.cancel()
            raise
        finally:
            del self._starting[key]
        starting.set_result(session)
        return session

    async def _start(self, key: str, body: dict[str, Any]) -> Session:
        rollout_id = self.rollout_id(key)
        attempt_id = f"{self.worker_id}-{secrets.token_hex(4)}"
        started = AttemptStarted(
            rollout_id=rollout_id, attempt_id=attempt_id, attempt_number=1,
            worker_id=self.worker_id, resources_id=self.config.resources_id,
            task=AttemptTask(
                input_json=session_task(body), mode=self.config.mode,
                metadata={"source": "gateway", "session": key},
            ),
        )  # fmt: skip
        await self.publisher.publish("rollouts", started)
        recorder = AttemptRecorder(rollout_id, attempt_id)
        recorder.start_clocks()
        ids = {ROLLOUT_HEADER: rollout_id, ATTEMPT_HEADER: attempt_id}
        route = AttemptRoute(recorder, {}, self.config.resources_id, answer_headers=ids)
        session = self.open[key] = Session(key, route, started)
        self.counts["sessions_started"] += 1
        return session

    async def pump(self) -> None:
        """Send the spans recorded since the last pump (a failure: sent again next time)."""
        for session in list(self.open.values()):
            await self._send_spans(session)

    async def _send_spans(self, session: Session) -> None:
        events = session.route.recorder.take(session.sent)
        if events:
            futures = [await self.publisher.send("spans", e) for e in events]
            await asyncio.gather(*futures)
            session.sent += len(events)

    async def end(self, key: str, grace: float = 5.0) -> None:
        """End a session: its calls in flight end, its spans and its end go to the broker."""
        session = self.open.get(key)
        if session is None or session.ending:
            return
        session.ending = True
        self.ended[key] = None
        while len(self.ended) > REMEMBERED_ENDED:
            self.ended.popitem(last=False)
        await session.route.drain(grace)
        count = session.route.recorder.close()
        try:
            await self._finish(session, count)
        except BaseException:
            session.ending = False  # the idle sweep ends it again (its spans are numbered)
            raise
        del self.open[key]
        self.counts["sessions_ended"] += 1

    async def _finish(self, session: Session, count: int) -> None:
        await self._send_spans(session)
        started = session.started
        finished = AttemptFinished(
            rollout_id=started.rollout_id, attempt_id=started.attempt_id, attempt_number=1,
            worker_id=self.worker_id, status=AttemptStatus.SUCCEEDED, span_count=count,
        )  # fmt: skip
        await self.publisher.publish("rollouts", finished)
        await self.publisher.publish(
            "rollouts",
            RolloutFinished(
                rollout_id=started.rollout_id, status=RolloutStatus.SUCCEEDED,
                attempt_id=started.attempt_id, attempt_count=1,
            ),
        )  # fmt: skip

    async def end_idle(self) -> None:
        now = time.monotonic()
        for key, session in list(self.open.items()):
            idle = now - session.last_call > self.config.idle_seconds
            if idle and not session.route.calls and not session.ending:
                await self.end(key)

    async def close(self) -> None:
        for key in list(self.open):
            try:
                await self.end(key, grace=1.0)
            except Exception as exc:  # noqa: BLE001 - the others still end; logged
                log.warning("session %s could not be ended: %r", key, exc)


def _start_refused(key: str, exc: Exception) -> SessionRefused:
    """Why a session could not start: its first call too large to be its task's record (413),
    or the broker's failure, whose details go to the log under an error id (503)."""
    if isinstance(exc, MessageSizeTooLargeError):
        message = (
            f"session {key!r} could not be started: its first call, which becomes the "
            "session's task, is larger than one Kafka record holds (1 MiB)"
        )
        return SessionRefused(message, 413)
    _, said = unexpected("START", f"session {key!r}", exc)
    return SessionRefused(f"session {key!r} could not be started: {said}", 503)
