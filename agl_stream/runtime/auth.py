"""Bearer-token authentication for agl-stream's HTTP servers (the gateway, `serve`, the
dashboard, the store): one setting, one check, one aiohttp middleware.

With AGL_STREAM_API_TOKEN set, a request passes when it carries `Authorization: Bearer
<token>` (or, from a browser that signed in through `login`, a cookie derived from the
token); anything else gets a 401 that says what to send. Only the liveness path (/health)
stays open, for probes. /metrics needs the token too: it names no rollout, but it tells
whoever asks what runs and how hard (calls, tokens, rewards posted, refusals), and one rule
("with a token, everything but /health needs it") is one an operator can check; Prometheus
sends it as any client does (`authorization: {credentials_file: ...}` in a scrape config).
Unset, nothing is checked: one machine's embedded stack listens on loopback only.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from aiohttp import web
from pydantic import Field, SecretStr, field_validator

from agl_stream.runtime.config import _Settings

TOKEN_VARIABLE = "AGL_STREAM_API_TOKEN"
OPEN_PATHS = frozenset({"/health"})
COOKIE = "agl_stream_session"
MIN_TOKEN_LENGTH = 16

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AuthSettings(_Settings):
    """The token this process's HTTP servers ask for, and the one its gateway sends on."""

    api_token: SecretStr | None = Field(
        default=None,
        description="Bearer token every request to this process's HTTP servers must carry.",
    )
    upstream_token: SecretStr | None = Field(
        default=None,
        description="Bearer token the gateway sends to its upstream (e.g. serve's api_token).",
    )

    @field_validator("api_token", "upstream_token", mode="before")
    @classmethod
    def _blank_is_unset(cls, value: object) -> object:
        # A deployment passes an empty variable for "no token" (compose's ${X:-}).
        if (
            isinstance(value, str | SecretStr)
            and not str(value.get_secret_value() if isinstance(value, SecretStr) else value).strip()
        ):
            return None
        return value

    @field_validator("api_token", "upstream_token")
    @classmethod
    def _long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value().strip()) < MIN_TOKEN_LENGTH:
            raise ValueError(
                f"a token needs at least {MIN_TOKEN_LENGTH} characters "
                "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
            )
        return value

    @property
    def token(self) -> str | None:
        return self.api_token.get_secret_value().strip() if self.api_token else None

    @property
    def upstream(self) -> str | None:
        return self.upstream_token.get_secret_value().strip() if self.upstream_token else None


def session_value(token: str) -> str:
    """What the sign-in cookie holds: derived from the token, never the token itself."""
    return hmac.new(token.encode(), b"agl-stream dashboard session", hashlib.sha256).hexdigest()


def bearer(request: web.Request) -> str | None:
    """The token of an `Authorization: Bearer ...` header, if the request has one."""
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def authorized(request: web.Request, token: str) -> bool:
    presented = bearer(request)
    if presented is not None:
        return hmac.compare_digest(presented.encode(), token.encode())
    cookie = request.cookies.get(COOKIE)
    return cookie is not None and hmac.compare_digest(cookie, session_value(token))


def refusal(request: web.Request, token: str | None) -> web.Response | None:
    """None when the request may go on (no token configured, or it carries the token); else
    the 401 to answer with. For a handler that checks by itself."""
    if token is None or authorized(request, token):
        return None
    given = "a wrong token" if bearer(request) is not None else "no token"
    message = (
        f"this server needs a bearer token and the request carried {given}: send "
        f"'Authorization: Bearer <token>' with the token of {TOKEN_VARIABLE}"
    )
    body = {"error": {"message": message, "type": "authentication_error", "code": 401}}
    return web.json_response(
        body, status=401, headers={"WWW-Authenticate": 'Bearer realm="agl-stream"'}
    )


def middleware(
    token: str | None,
    open_paths: Collection[str] = OPEN_PATHS,
    allow: Callable[[web.Request], bool] | None = None,
    login: bool = False,
) -> Any:
    """An aiohttp middleware refusing requests without the token; `open_paths` and requests
    that `allow` accepts (a route with a credential of its own) are let through. With
    `login`, /login is open and a browser asking for a page is sent there instead of a 401."""
    opened = frozenset(open_paths) | (LOGIN_PATHS if login else frozenset())

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in opened or (allow is not None and allow(request)):
            return await handler(request)
        refused = refusal(request, token)
        if refused is None:
            return await handler(request)
        if login and request.method == "GET" and "text/html" in request.headers.get("Accept", ""):
            raise web.HTTPSeeOther("/login")
        return refused

    return check


def protect(app: web.Application, token: str | None, **options: Any) -> None:
    """Put the check in front of every route of `app` (a no-op without a token). Call before
    the app is started; the check runs before the app's other middlewares."""
    if token is not None:
        app.middlewares.insert(0, middleware(token, **options))


def add_login(app: web.Application, token: str | None, landing: str = "/") -> None:
    """POST /login (form field `token`) sets the session cookie a browser then sends with
    every request, page and event stream alike (EventSource cannot send headers)."""
    if token is None:
        return

    async def login(request: web.Request) -> web.StreamResponse:
        form = await request.post()
        given = str(form.get("token", "")).strip()
        if not hmac.compare_digest(given.encode(), token.encode()):
            return web.Response(status=401, text="wrong token", content_type="text/plain")
        response = web.Response(status=303, headers={"Location": landing})
        response.set_cookie(
            COOKIE, session_value(token), httponly=True, samesite="Strict", path="/"
        )
        return response

    async def login_page(request: web.Request) -> web.Response:
        return web.Response(text=LOGIN_PAGE, content_type="text/html")

    app.router.add_post("/login", login)
    app.router.add_get("/login", login_page)


LOGIN_PAGE = """<!doctype html><meta charset="utf-8"><title>agl-stream: sign in</title>
<form method="post" action="/login"><label>Token of AGL_STREAM_API_TOKEN
<input name="token" type="password" autofocus></label> <button>Sign in</button></form>
"""
LOGIN_PATHS = frozenset({"/login"})


def credential_refusal(request: web.Request, token: str | None, what: str) -> web.Response | None:
    """For a route with a credential of its own (POST /rewards, the OTLP receiver): None when
    the request carries that token; else a 401 (no bearer token) or 403 (another one). With no
    token configured, `what` is refused with a 403 saying how to enable it."""
    if token is None:
        return _refused(
            403, f"{what} is disabled on this server: start the server with a token for it",
            "permission_error",
        )  # fmt: skip
    given = bearer(request)
    if given is None:
        return _refused(
            401, f"{what} needs 'Authorization: Bearer <token>'", "authentication_error"
        )
    if not hmac.compare_digest(given.encode(), token.encode()):
        return _refused(403, f"this token is not the token of {what}", "permission_error")
    return None


def _refused(status: int, message: str, kind: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": None}}  # OpenAI's shape
    return web.json_response(body, status=status)
