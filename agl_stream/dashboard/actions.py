"""Who may read and act: with a token configured, every API call carries it (as a bearer
token, or the session cookie that POST /api/session sets for the page's event stream) and a
call without it is a 401; cancel and requeue are allowed only then, and only with the bearer
header (a cookie alone never acts, so another site cannot make a browser act). Without a
token the dashboard is read-only: the actions answer 403 and say how to enable them."""

from __future__ import annotations

import hmac
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agl_stream.cancel import OPEN_STATUSES, cancel
from agl_stream.dashboard.api import KAFKA, READ_MODEL, Handler, error
from agl_stream.requeue import RequeueError, requeue

TOKEN = web.AppKey("token", str)
COOKIE = "agl_dashboard"
OPEN_PATHS = frozenset({"/api/session", "/api/openapi.json"})
MAX_BODY = 64 * 1024


class SessionRequest(BaseModel):
    token: str = Field(min_length=1)


class CancelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str | None = Field(default=None, max_length=1_000)


class RequeueRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ActionDone(BaseModel):
    rollout_id: str  # the rollout acted on
    action: str  # cancel | requeue
    requeued_as: str | None = None  # requeue: the id of the new rollout


def _presented(request: web.Request, cookie: bool) -> str | None:
    header = request.headers.get("Authorization", "")
    if header.startswith("Bearer "):
        return header[len("Bearer ") :]
    return request.cookies.get(COOKIE) if cookie else None


def _matches(presented: str | None, token: str) -> bool:
    return presented is not None and hmac.compare_digest(presented.encode(), token.encode())


@web.middleware
async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
    token = request.app.get(TOKEN)
    guarded = request.path.startswith("/api/") and request.path not in OPEN_PATHS
    if token and guarded and not _matches(_presented(request, request.method == "GET"), token):
        response = error(401, "this dashboard needs its token: Authorization: Bearer TOKEN")
        response.headers["WWW-Authenticate"] = 'Bearer realm="agl-stream dashboard"'
        return response
    return await handler(request)


async def _body(request: web.Request, model: type[BaseModel]) -> Any:
    if request.content_length and request.content_length > MAX_BODY:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY, actual_size=request.content_length)
    raw = await request.read()
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        raise _Refused(400, f"bad request body: {problems}") from None


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _acting(request: web.Request) -> None:
    if not request.app.get(TOKEN):
        raise _Refused(
            403,
            "the dashboard is read-only: start it with --token (or AGL_STREAM_DASHBOARD_TOKEN) "
            "to allow cancel and requeue",
        )


async def session(request: web.Request) -> web.Response:
    """POST /api/session {"token": ...}: the page's login; sets the cookie its event stream
    sends (an EventSource cannot send a header)."""
    try:
        token = request.app.get(TOKEN)
        if not token:
            raise _Refused(400, "this dashboard has no token: it is open and read-only")
        body: SessionRequest = await _body(request, SessionRequest)
        if not _matches(body.token, token):
            raise _Refused(401, "wrong token")
    except _Refused as exc:
        return error(exc.status, str(exc))
    response = web.json_response({"ok": True})
    response.set_cookie(COOKIE, body.token, httponly=True, samesite="Strict", path="/api/")
    return response


async def cancel_rollout(request: web.Request) -> web.Response:
    """POST /api/rollouts/{rollout_id}/cancel {"reason": ...}: 202 once the broker has it."""
    try:
        _acting(request)
        body: CancelRequest = await _body(request, CancelRequest)
        rollout = await request.app[READ_MODEL].rollout(request.match_info["rollout_id"])
        if rollout.status not in OPEN_STATUSES:
            raise _Refused(409, f"rollout {rollout.rollout_id!r} is {rollout.status} already")
    except _Refused as exc:
        return error(exc.status, str(exc))
    reason = body.reason or "cancelled from the dashboard"
    await cancel(request.app[KAFKA], [rollout.rollout_id], reason, "dashboard")
    done = ActionDone(rollout_id=rollout.rollout_id, action="cancel")
    return web.json_response(done.model_dump(mode="json"), status=202)


async def requeue_rollout(request: web.Request) -> web.Response:
    """POST /api/rollouts/{rollout_id}/requeue: 202 with the new rollout's id."""
    try:
        _acting(request)
        await _body(request, RequeueRequest)
        rollout = await request.app[READ_MODEL].rollout(request.match_info["rollout_id"])
        try:
            copy_id = await requeue(request.app[KAFKA], rollout)
        except RequeueError as exc:
            raise _Refused(409, str(exc)) from None
    except _Refused as exc:
        return error(exc.status, str(exc))
    done = ActionDone(rollout_id=rollout.rollout_id, action="requeue", requeued_as=copy_id)
    return web.json_response(done.model_dump(mode="json"), status=202)
