"""What agl-stream's HTTP servers answer when a request goes wrong, in one place.

- A request the server cannot take (bad input, an id that breaks the id rule, a body over the
  server's limit) is a 4xx with a sentence saying why.
- Anything unexpected is a bare 500 that carries an error id (in the body and in the
  `X-Error-Id` header); the traceback goes to the log under that id, never into the answer:
  file paths, versions and code are no business of whoever sent the request.
- Bodies are bounded: each server takes at most what its largest legitimate request needs
  (aiohttp's `client_max_size`, counted as the body is read, after decompression, so a gzip
  bomb stops at the limit too), and answers 413 above it.

`guard` is the aiohttp middleware of the gateway (its /rewards route included), the OTLP
receiver, the policy server, the dashboard and the workers' metrics; the store facade (FastAPI)
has a guard of its own (agl_stream.compat.agl.guard) that logs and answers with `unexpected` below.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from agl_stream.events.ids import require_id

log = logging.getLogger("agl_stream.http")

ERROR_ID_HEADER = "X-Error-Id"
# The body of an error: (status, sentence, kind) -> response, in the shape of the server's API.
Shape = Callable[[int, str, str], web.Response]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_KEPT_HEADERS = frozenset({"allow", "www-authenticate", "retry-after"})


class Refused(Exception):
    """A request the server will not take: answered `status` with `message`, nothing logged."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


def openai_error(status: int, message: str, kind: str) -> web.Response:
    """OpenAI's error shape, which the gateway, `serve` and the token checks answer with."""
    body = {"error": {"message": message, "type": kind, "code": None}}
    return web.json_response(body, status=status)


def unexpected(method: str, path: str, exc: BaseException) -> tuple[str, str]:
    """Log an unexpected failure with its traceback under a new error id; the id and the
    sentence to answer with (which names nothing but the id)."""
    error_id = uuid.uuid4().hex[:16]
    log.error("error %s answering %s %r", error_id, method, path[:300], exc_info=exc)
    return error_id, f"internal error {error_id}: the server's log has the details under this id"


def guard(shape: Shape = openai_error) -> Any:
    """An aiohttp middleware: `Refused` and aiohttp's own refusals (404, 405, 413...) as 4xx
    in `shape` with their reason; anything else a bare 500 with an error id."""

    @web.middleware
    async def answer(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except Refused as exc:
            return shape(exc.status, exc.message, exc.kind)
        except web.HTTPException as exc:
            if exc.status < 400 or exc.content_type != "text/plain":
                raise  # a redirect, or an answer a handler built on purpose
            return _reshaped(exc, shape)
        except ConnectionResetError:
            raise  # the client went away: there is nobody to answer, and no fault of ours
        except Exception as exc:
            error_id, message = unexpected(request.method, request.path, exc)
            if request.writer.output_size > 0:
                # The answer has begun (a stream): nothing more can be said; aiohttp closes it.
                raise
            response = shape(500, message, "server_error")
            response.headers[ERROR_ID_HEADER] = error_id
            return response

    return answer


def install(app: web.Application, shape: Shape = openai_error) -> None:
    """Put `guard` in front of everything `app` runs, its token check included (call after
    agl_stream.runtime.auth.protect)."""
    app.middlewares.insert(0, guard(shape))


def _reshaped(exc: web.HTTPException, shape: Shape) -> web.Response:
    reason = (exc.text or "").strip() or exc.reason
    if exc.status == 413:
        reason = f"the request body is too large for this server: {reason}"
    response = shape(exc.status, reason, "invalid_request_error")
    for name, value in exc.headers.items():
        if name.lower() in _KEPT_HEADERS:
            response.headers[name] = value
    return response


def path_id(request: web.Request, name: str, field: str | None = None) -> str:
    """The URL path's `name` part, checked by the id rule (Refused 400 naming `field`)."""
    return checked_id(field or name, request.match_info[name])


def checked_id(field: str, value: object) -> str:
    """`value` if it is a valid id (agl_stream.events.ids); Refused 400 naming `field`."""
    try:
        return require_id(field, value)
    except ValueError as exc:
        raise Refused(400, str(exc)) from None


async def read_body(request: web.Request, limit: int, what: str) -> bytes:
    """The body, at most `limit` bytes (decompressed); Refused 413 naming the limit above it.
    For a route that takes less than its app's client_max_size."""
    too_large = Refused(413, f"{what} takes a body of at most {limit:,} bytes", "request_too_large")
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.content.iter_any():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)
