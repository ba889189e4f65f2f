"""Cancel and requeue, allowed only when the dashboard has a token (agl_stream/runtime/auth.py
checks it before any handler runs: a bearer header, or the cookie a browser got at /login). A call
authenticated by the cookie alone must also carry the header X-AGL-Dashboard, which a page of
another site cannot add without a CORS preflight this server never grants: a cookie alone
never acts. Without a token the dashboard is read-only: the actions answer 403 and say how
to enable them."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agl_stream.commands.cancel import OPEN_STATUSES, cancel
from agl_stream.commands.requeue import RequeueError, requeue
from agl_stream.dashboard.api import ACTIONS, KAFKA, READ_MODEL, error, rollout_id_of
from agl_stream.runtime import auth

MAX_BODY = 64 * 1024


class CancelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str | None = Field(default=None, max_length=1_000)


class RequeueRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ActionDone(BaseModel):
    rollout_id: str  # the rollout acted on
    action: str  # cancel | requeue
    requeued_as: str | None = None  # requeue: the id of the new rollout


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


ACTION_HEADER = "X-AGL-Dashboard"


def _acting(request: web.Request) -> None:
    if not request.app[ACTIONS]:
        raise _Refused(
            403,
            "the dashboard is read-only: start it with --token (or AGL_STREAM_API_TOKEN) "
            "to allow cancel and requeue",
        )
    if auth.bearer(request) is None and ACTION_HEADER not in request.headers:
        raise _Refused(403, f"an action signed in by cookie needs the {ACTION_HEADER} header")


async def cancel_rollout(request: web.Request) -> web.Response:
    """POST /api/rollouts/{rollout_id}/cancel {"reason": ...}: 202 once the broker has it."""
    try:
        _acting(request)
        body: CancelRequest = await _body(request, CancelRequest)
        rollout = await request.app[READ_MODEL].rollout(rollout_id_of(request))
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
        rollout = await request.app[READ_MODEL].rollout(rollout_id_of(request))
        try:
            copy_id = await requeue(request.app[KAFKA], rollout)
        except RequeueError as exc:
            raise _Refused(409, str(exc)) from None
    except _Refused as exc:
        return error(exc.status, str(exc))
    done = ActionDone(rollout_id=rollout.rollout_id, action="requeue", requeued_as=copy_id)
    return web.json_response(done.model_dump(mode="json"), status=202)
