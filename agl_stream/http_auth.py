"""The one bearer-token check of agl-stream's HTTP ingress (rewards, OTLP): a request must
carry `Authorization: Bearer <token>`; compared in constant time."""

from __future__ import annotations

import hmac

from aiohttp import web

from agl_stream.gateway.wire import error_body


def bearer_refusal(request: web.Request, token: str | None, what: str) -> web.Response | None:
    """None when the request may go on; else the 401 (no token) or 403 (another token) to
    answer. With no token configured, `what` is refused with a 403 saying how to enable it."""
    if token is None:
        return _answer(
            403, f"{what} is disabled on this server: start the server with a token for it",
            "permission_error",
        )  # fmt: skip
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return _answer(401, f"{what} needs 'Authorization: Bearer <token>'", "authentication_error")
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        return _answer(403, f"this token is not the token of {what}", "permission_error")
    return None


def _answer(status: int, message: str, kind: str) -> web.Response:
    return web.Response(
        status=status, body=error_body(message, kind), content_type="application/json"
    )
