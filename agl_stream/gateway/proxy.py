"""The gateway: an OpenAI-compatible HTTP endpoint in front of any OpenAI-compatible upstream.
Each call is forwarded (streams as streams), then recorded whole as one `agl.llm.call` span
of the attempt its URL names, with token ids and logprobs asked of the upstream. Upstream
errors reach the agent as the upstream gave them; a dead or silent upstream becomes a 502 or
504 in OpenAI's error shape (mid-stream: an error event), and the call is recorded as failed.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web
from aiokafka.errors import MessageSizeTooLargeError
from opentelemetry import context as otel_context
from opentelemetry.context import Context

from agl_stream.agent.llm import POLICY, LLMCall, record_llm_call
from agl_stream.agent.tracing import AttemptRecorder, Tracing, current_recorder
from agl_stream.bus.codec import Codec
from agl_stream.bus.kafka import MAX_RECORD_BYTES
from agl_stream.bus.streams import EventPublisher
from agl_stream.events import LLM, SpanRecorded
from agl_stream.events.spans import too_large_stand_in
from agl_stream.gateway.events import BadEvents, parse_events
from agl_stream.gateway.recording import UNATTRIBUTED, AttemptRoute, CallLog, policy_routes
from agl_stream.gateway.reward_route import RewardEndpoint
from agl_stream.gateway.routes import (
    ENDPOINTS,
    RESOURCES_HEADER,
    Identity,
    attempt_base_url,
    parse_path,
    upstream_url,
)
from agl_stream.gateway.sessions import (
    CALL_HEADER,
    SESSION_END_HEADER,
    Session,
    SessionConfig,
    SessionRefused,
    Sessions,
)
from agl_stream.gateway.wire import (
    BadRequest,
    CallKind,
    CallRecord,
    SSEDecoder,
    error_body,
    parse_request,
    prepare_request,
    read_chunk,
)
from agl_stream.runtime import auth, http_errors
from agl_stream.runtime.http import Listening, guarded_app
from agl_stream.runtime.redaction import NO_REDACTION, Redaction
from agl_stream.runtime.supervision import restarting
from agl_stream.telemetry.metrics import WorkerMetrics

FORWARDED_HEADERS = ("Authorization", "OpenAI-Organization", "OpenAI-Project", "Accept")
PUMP_SECONDS = 0.2
# Calls without an attempt whose spans are not on the broker yet, at most: past it (the
# broker unreachable for a while) such calls get a 503 instead of spans piling up in memory.
MAX_WAITING_SPANS = 50_000
# The largest legitimate request is an LLM call forwarded whole: a long conversation with
# images inlined as base64 data URLs (OpenAI takes images of up to 20 MB each), or a process
# agent's events with such a call's spans. 64 MiB holds a few of those; above it, a 413.
MAX_BODY = 64 * 1024 * 1024


class UpstreamFailed(Exception):
    """The upstream could not be reached, broke off, or did not answer in time."""


class Gateway:
    """Routes per attempt (registered by the runner that runs it) and a default upstream for
    calls with no attempt. `publisher` sends the unattributed calls' spans."""

    def __init__(
        self,
        default_upstream: str | None = None,
        publisher: EventPublisher | None = None,
        upstream_timeout: float = 600.0,
        sessions: SessionConfig | None = None,
        reward_token: str | None = None,
        token: str | None = None,
        upstream_token: str | None = None,
        redaction: Redaction = NO_REDACTION,
    ) -> None:
        self.default_upstream = default_upstream
        # With a token, calls off an attempt's URL need it (an attempt's URL is a capability
        # of its own, keyed for process agents); upstream_token goes to the upstream instead
        # of what the caller sent, and the gateway's own token never goes on.
        self.token = token
        self.upstream_token = upstream_token
        self.redaction = redaction  # of the calls without an attempt (the call log)
        self.publisher = publisher
        self.upstream_timeout = upstream_timeout
        # Calls with a session key become rollouts (gateway/sessions.py); needs a publisher.
        self.sessions = (
            Sessions(publisher, sessions) if sessions is not None and publisher else None
        )
        self.rewards = (
            RewardEndpoint(
                publisher, reward_token, self.sessions.rollout_id if self.sessions else None
            )
            if publisher is not None
            else None
        )
        self.routes: dict[tuple[str, str], AttemptRoute] = {}
        self.log = CallLog()
        self.url = ""
        self.counts: dict[str, int] = {"calls": 0, "failed": 0, "unattributed": 0}
        self.metrics = WorkerMetrics("gateway", self._snapshot)
        self._listening: Listening | None = None
        self._session: aiohttp.ClientSession | None = None
        self._pump: asyncio.Task[None] | None = None

    def _snapshot(self) -> dict[str, int]:
        counts = dict(self.counts)
        if self.sessions is not None:
            counts.update(self.sessions.counts)
            counts["sessions_open"] = len(self.sessions.open)
        if self.rewards is not None:
            counts["rewards"] = self.rewards.recorded
        return counts

    # -- attempts ---------------------------------------------------------------------------

    def open_attempt(
        self,
        recorder: AttemptRecorder,
        resources: Mapping[str, Any],
        resources_id: str | None,
        parent: Context | None = None,
        key: str | None = None,
    ) -> tuple[AttemptRoute, dict[str, Any]]:
        """Register an attempt; returns its route and its resources with every LLM pointed
        at this gateway. With a `key`, the attempt's URLs (its LLMs' and its event URL) refuse
        any call that does not carry it as a bearer token."""
        upstreams = {name: r.endpoint for name, r in resources.items() if isinstance(r, LLM)}
        policies, served = policy_routes(resources)
        route = AttemptRoute(
            recorder, upstreams, resources_id, parent, key=key, policies=policies, served=served
        )
        self.routes[(recorder.rollout_id, recorder.attempt_id)] = route
        routed = dict(resources)
        for name in upstreams:
            identity = Identity(recorder.rollout_id, recorder.attempt_id, name)
            routed[name] = resources[name].model_copy(
                update={"endpoint": attempt_base_url(self.url, identity)}
            )
        return route, routed

    async def close_attempt(self, rollout_id: str, attempt_id: str, grace: float = 5.0) -> None:
        """Let the attempt's calls in flight end (or cancel them after `grace`); later calls
        on its URL are refused."""
        route = self.routes.get((rollout_id, attempt_id))
        if route is not None:
            await route.drain(grace)
            del self.routes[(rollout_id, attempt_id)]

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        Tracing.install()
        app = guarded_app(MAX_BODY, self.token, allow=_own_credential)
        app.router.add_get("/metrics", self.metrics.respond)  # before the routes to upstreams
        app.router.add_post("/rollouts/{rollout}/attempts/{attempt}/events", self._events)
        if self.rewards is not None:
            self.rewards.add_to(app)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._listening = await Listening.start(app, host, port)
        self.url = self._listening.url
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_read=self.upstream_timeout),
        )
        if self.publisher is not None:
            self._pump = asyncio.create_task(
                restarting(self._pump_log, "the gateway's span pump"), name="span pump"
            )
        return self.url

    async def stop(self) -> None:
        for route in list(self.routes.values()):
            await route.drain(1.0)
        if self._listening is not None:
            await self._listening.stop()
        if self.sessions is not None:
            await self.sessions.close()
        if self._session is not None:
            await self._session.close()
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)
        await self._send_log()

    async def _pump_log(self) -> None:
        while True:
            await asyncio.sleep(PUMP_SECONDS)
            await self._send_log()
            if self.sessions is not None:
                await self.sessions.pump()
                await self.sessions.end_idle()

    async def _send_log(self) -> None:
        """Send the calls' spans. What the broker does not take goes back to the front of the
        log, in order (the pump, restarted with a backoff, sends it again); a span too large
        to be a record goes as a stand-in that says so. Nothing is dropped."""
        if self.publisher is None:
            return
        batch = self.log.drain()
        queued: list[tuple[SpanRecorded, asyncio.Future[Any]]] = []
        for i, event in enumerate(batch):
            try:
                queued.append((event, await self._send_span(event)))
            except BaseException:
                self._put_back([e for e, _ in queued], batch[i:])
                raise
        results = await asyncio.gather(*(f for _, f in queued), return_exceptions=True)
        failed = [
            e for (e, _), r in zip(queued, results, strict=True) if isinstance(r, BaseException)
        ]
        if failed:
            self._put_back(failed, [])
            raise next(r for r in results if isinstance(r, BaseException))

    async def _send_span(self, event: SpanRecorded) -> asyncio.Future[Any]:
        assert self.publisher is not None
        event = self.redaction.span(event)
        try:
            return await self.publisher.send("spans", event)
        except MessageSizeTooLargeError:
            size = len(Codec().encode(event))
            self.counts["spans_too_large"] = self.counts.get("spans_too_large", 0) + 1
            return await self.publisher.send(
                "spans", too_large_stand_in(event, size, MAX_RECORD_BYTES)
            )

    def _put_back(self, failed: list[SpanRecorded], unsent: list[SpanRecorded]) -> None:
        self.log.put_back(failed + unsent)
        self.counts["span_batches_failed"] = self.counts.get("span_batches_failed", 0) + 1

    # -- an agent's events -------------------------------------------------------------------

    async def _events(self, request: web.Request) -> web.Response:
        """Events a process agent POSTs to its attempt's event URL, recorded as its spans."""
        rollout_id = http_errors.path_id(request, "rollout", "the rollout id")
        attempt_id = http_errors.path_id(request, "attempt", "the attempt id")
        route = self.routes.get((rollout_id, attempt_id))
        if route is None:
            message = (
                f"attempt {attempt_id} of rollout {rollout_id} is not running behind this gateway"
            )
            return _error(410, message, "attempt_not_running")
        if (refused := _refused_key(request, route)) is not None:
            return refused
        task = asyncio.current_task()
        if task is not None:  # the attempt's end waits for it, as for an LLM call
            route.calls.add(task)
        try:
            try:
                events = parse_events(await request.read())
            except BadEvents as exc:
                return _error(400, str(exc), "invalid_request_error")
            recorder_token = current_recorder.set(route.recorder)
            context_token = otel_context.attach(route.parent or Context())
            try:
                for event in events:
                    event.record()
            finally:
                otel_context.detach(context_token)
                current_recorder.reset(recorder_token)
            self.counts["events"] = self.counts.get("events", 0) + len(events)
            return web.json_response({"recorded": len(events)})
        finally:
            if task is not None:
                route.calls.discard(task)

    # -- one call ---------------------------------------------------------------------------

    def _headers(self, request: web.Request, route: AttemptRoute | None) -> dict[str, str]:
        forwarded: tuple[str, ...] = FORWARDED_HEADERS
        keyed = route is not None and route.key is not None  # the attempt's key stays here
        own = self.token is not None and auth.bearer(request) == self.token
        if keyed or own or self.upstream_token is not None:
            forwarded = tuple(name for name in forwarded if name != "Authorization")
        headers = {name: request.headers[name] for name in forwarded if name in request.headers}
        if self.upstream_token is not None:
            headers["Authorization"] = f"Bearer {self.upstream_token}"
        if route is not None and route.resources_id is not None:
            # The version the attempt runs on: a policy server catches up to it first.
            headers[RESOURCES_HEADER] = route.resources_id
        return headers

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            identity, endpoint = parse_path(request.path)
        except ValueError as exc:
            return _error(404, str(exc), "not_found")
        if identity is not None:
            http_errors.checked_id("the rollout id", identity.rollout_id)
            http_errors.checked_id("the attempt id", identity.attempt_id)
        route = self.routes.get((identity.rollout_id, identity.attempt_id)) if identity else None
        session: Session | None = None
        key = request.headers.get(self.sessions.config.header) if self.sessions else None
        recorded_call = ENDPOINTS.get(endpoint) is not None and request.method == "POST"
        if identity is None and key is not None and self.sessions is not None and recorded_call:
            # (only calls that are recorded: a session is its LLM calls, not a model listing)
            try:
                session = await self.sessions.route(key, _json_object(await request.read()))
            except SessionRefused as exc:
                return _error(exc.status, str(exc), "invalid_request_error")
            route = session.route
        if identity is not None and route is None:
            message = (
                f"attempt {identity.attempt_id} of rollout {identity.rollout_id} is not running "
                "behind this gateway (it ended, or runs in another runner)"
            )
            return _error(410, message, "attempt_not_running")
        if route is not None and (refused := _refused_key(request, route)) is not None:
            return refused
        upstream = self._upstream(identity, route)
        if upstream is None:
            return _error(404, "this gateway has no upstream for calls without an attempt URL")
        if route is None and self.publisher is not None and self.log.waiting() > MAX_WAITING_SPANS:
            message = (
                f"{self.log.waiting():,} recorded calls are waiting to reach the broker; "
                "this gateway takes no more until they do"
            )
            return _error(503, message, "spans_backlog")
        kind = ENDPOINTS.get(endpoint)
        if kind is None or request.method != "POST":
            return await self._pass_through(request, upstream_url(upstream, endpoint), route)
        task = asyncio.current_task()
        if route is not None and task is not None:
            route.calls.add(task)
        try:
            resource = identity.resource if identity is not None else ""
            return await self._call(request, kind, (upstream, endpoint, resource), route)
        finally:
            if route is not None and task is not None:
                route.calls.discard(task)
            if session is not None and request.headers.get(SESSION_END_HEADER, "") in _YES:
                assert self.sessions is not None
                await self.sessions.end(session.key)

    def _upstream(self, identity: Identity | None, route: AttemptRoute | None) -> str | None:
        if identity is None or route is None:
            return self.default_upstream
        return route.upstreams.get(identity.resource)

    async def _call(
        self,
        request: web.Request,
        kind: CallKind,
        to: tuple[str, str, str],
        route: AttemptRoute | None,
    ) -> web.StreamResponse:
        """A recorded call `to` (upstream, endpoint, the LLM resource called); one naming a
        policy of its attempt goes to that policy's upstream."""
        upstream, endpoint, resource = to
        try:
            body = parse_request(await request.read())
        except BadRequest as exc:
            return _error(400, str(exc), "invalid_request_error")
        recorded = _Recorded(self, route, CallRecord(kind, body))
        if route is not None:
            recorded.policy = route.policy_of(resource, body.get("model"))
            upstream = route.policies.get(recorded.policy or "", upstream)
        url = upstream_url(upstream, endpoint)
        if route is not None:
            route.recorder.touch()
            recorded.headers.update(route.answer_headers)
        try:
            if body.get("stream"):
                return await self._stream(request, url, body, recorded)
            return await self._whole(request, url, body, recorded)
        except asyncio.CancelledError:
            recorded.finish(None, "cancelled: the attempt ended before the call did")
            raise
        finally:
            recorded.finish(None, "the call ended without an answer")

    async def _whole(
        self, request: web.Request, url: str, body: dict[str, Any], recorded: _Recorded
    ) -> web.StreamResponse:
        try:
            async with self._post(request, url, body, recorded) as upstream:
                raw = await upstream.read()
                served_by = upstream.headers.get(RESOURCES_HEADER)
                status, content_type = upstream.status, upstream.content_type
        except (aiohttp.ClientError, TimeoutError) as exc:
            recorded.finish(None, _failure(exc))
            return _upstream_error(exc)
        if status >= 400:
            recorded.finish(served_by, _refused(status, raw))
        else:
            try:
                recorded.record.add_response(json.loads(raw))
                recorded.finish(served_by, None)
            except (ValueError, TypeError, KeyError) as exc:
                recorded.finish(served_by, f"upstream answer unreadable: {exc}")
        headers = {RESOURCES_HEADER: served_by} if served_by else {}
        headers.update(recorded.headers)
        if recorded.headers and recorded.span_id is not None:
            headers[CALL_HEADER] = recorded.span_id
        return web.Response(status=status, body=raw, content_type=content_type, headers=headers)

    async def _stream(
        self, request: web.Request, url: str, body: dict[str, Any], recorded: _Recorded
    ) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        decoder = SSEDecoder()
        served_by: str | None = None
        failed: str | None = None  # an error event the upstream sent mid-stream
        try:
            async with self._post(request, url, body, recorded) as upstream:
                served_by = upstream.headers.get(RESOURCES_HEADER)
                if upstream.status >= 400:
                    raw = await upstream.read()
                    recorded.finish(served_by, _refused(upstream.status, raw))
                    return web.Response(
                        status=upstream.status, body=raw, content_type=upstream.content_type
                    )
                headers = {
                    "Content-Type": upstream.headers.get("Content-Type", "text/event-stream"),
                    "Cache-Control": "no-cache",
                }
                if served_by:
                    headers[RESOURCES_HEADER] = served_by
                headers.update(recorded.headers)
                response = web.StreamResponse(status=upstream.status, headers=headers)
                await response.prepare(request)
                async for data in upstream.content.iter_any():
                    await response.write(data)
                    for event in decoder.feed(data):
                        chunk = read_chunk(event)
                        if chunk is not None and "error" in chunk:
                            failed = f"the upstream failed mid-stream: {chunk['error']}"
                        elif chunk is not None:
                            recorded.record.add_chunk(chunk)
                    if recorded.route is not None:
                        recorded.route.recorder.touch()
        except (aiohttp.ClientError, TimeoutError) as exc:
            recorded.finish(served_by, _failure(exc))
            if response is None:
                return _upstream_error(exc)
            # Headers are gone: tell the client in the stream, as OpenAI's servers do.
            await response.write(b"data: " + error_body(_failure(exc), "upstream_error") + b"\n\n")
            return response
        recorded.finish(served_by, failed)
        await response.write_eof()
        return response

    def _post(
        self, request: web.Request, url: str, body: dict[str, Any], recorded: _Recorded
    ) -> Any:  # aiohttp's request context manager
        """The call as the upstream gets it: token ids and logprobs asked for."""
        assert self._session is not None
        return self._session.post(
            url,
            json=prepare_request(recorded.record.kind, body),
            headers=self._headers(request, recorded.route),
        )

    async def _pass_through(
        self, request: web.Request, url: str, route: AttemptRoute | None
    ) -> web.StreamResponse:
        """Anything else (GET /v1/models, embeddings): forwarded, not recorded."""
        assert self._session is not None
        try:
            async with self._session.request(
                request.method,
                url,
                data=await request.read(),
                headers=self._headers(request, route),
            ) as upstream:
                raw = await upstream.read()
                return web.Response(
                    status=upstream.status, body=raw, content_type=upstream.content_type
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            return _error(502, _failure(exc), "upstream_error")


class _Recorded:
    """Records a call exactly once, whichever way it ends."""

    def __init__(self, gateway: Gateway, route: AttemptRoute | None, record: CallRecord) -> None:
        self.gateway = gateway
        self.route = route
        self.record = record
        self.started = time.time_ns()  # the span's start
        self.clock = time.monotonic()  # its latency
        self.done = False
        self.headers: dict[str, str] = {}  # for the answer (a session's ids)
        self.span_id: str | None = None  # the call's span, once recorded
        self.policy: str | None = None  # the policy that answers it (several policies)

    def finish(self, served_by: str | None, error: str | None) -> None:
        if self.done:
            return
        self.done = True
        extra: dict[str, Any] = {"agl.gateway.latency_ms": (time.monotonic() - self.clock) * 1000}
        if self.record.chunks:
            extra["agl.gateway.stream_chunks"] = self.record.chunks
        route = self.route
        resources_id = served_by or (route.resources_id if route is not None else None)
        if self.policy is not None:
            extra[POLICY] = self.policy
        call: LLMCall = self.record.call(resources_id, extra)
        recorder = route.recorder if route is not None else self.gateway.log
        counts = self.gateway.counts
        counts["calls"] += 1
        counts["failed"] += error is not None
        counts["unattributed"] += recorder.rollout_id == UNATTRIBUTED
        counts["prompt_tokens"] = counts.get("prompt_tokens", 0) + len(call.prompt_token_ids or ())
        counts["response_tokens"] = counts.get("response_tokens", 0) + len(
            call.response_token_ids or ()
        )
        self.gateway.metrics.observe(
            "call", time.monotonic() - self.clock, "A call through the gateway, upstream included."
        )
        token = current_recorder.set(recorder)
        try:
            parent = route.parent if route is not None else None
            self.span_id = record_llm_call(call, self.started, error, parent=parent or Context())
        finally:
            current_recorder.reset(token)


def _own_credential(request: web.Request) -> bool:
    """Routes that check a credential of their own: an attempt's URL (its key) and POST
    /rewards (the reward token)."""
    return request.path.startswith("/rollouts/") or request.path == "/rewards"


def _refused_key(request: web.Request, route: AttemptRoute) -> web.Response | None:
    """None when the call may go on: the route is open, or the call carries its key."""
    if route.key is None:
        return None
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        message = "this attempt's URLs need its key: send 'Authorization: Bearer $AGL_KEY'"
        return _error(401, message, "authentication_error")
    if not hmac.compare_digest(token.strip().encode(), route.key.encode()):
        recorder = route.recorder
        message = (
            f"this key is not the key of attempt {recorder.attempt_id} of rollout "
            f"{recorder.rollout_id}"
        )
        return _error(403, message, "permission_error")
    return None


_YES = frozenset({"1", "true", "yes", "on"})


def _json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or {} (the call itself then says what is wrong)."""
    try:
        body = json.loads(raw or b"null")
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _refused(status: int, raw: bytes) -> str:
    return f"upstream answered {status}: {raw[:500]!r}"


def _upstream_error(exc: BaseException) -> web.Response:
    return _error(504 if isinstance(exc, TimeoutError) else 502, _failure(exc), "upstream_error")


def _failure(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "the upstream did not answer in time"
    return f"the upstream failed: {type(exc).__name__}: {exc}"


def _error(status: int, message: str, kind: str = "gateway_error") -> web.Response:
    return web.Response(
        status=status, body=error_body(message, kind), content_type="application/json"
    )
