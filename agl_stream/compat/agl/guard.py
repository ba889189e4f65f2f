"""The store facade's guard: a pure ASGI middleware in front of Agent Lightning's FastAPI app
(agl_stream.runtime.http_errors' rules, for the one server that is not aiohttp).

- Bodies are bounded: a Content-Length over MAX_BODY, or a body that grows past it, is a 413
  with a sentence before the app sees any of it. A gzip body (OTLP exporters compress theirs)
  is inflated here, also only up to MAX_BODY, and handed on plain: Agent Lightning's /v1/traces
  would inflate it whole, however large it grew.
- A 500 never carries internals: Agent Lightning's server answers an unexpected error with its
  traceback (its `_app_exception_handler`); every 500 from the app, and any exception it
  raises, becomes a bare 500 with an error id, the details going to the log under that id.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from agl_stream.runtime.http_errors import ERROR_ID_HEADER, unexpected

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# The largest legitimate request is a batch: an OTLP export (OpenTelemetry's BatchSpanProcessor
# sends up to 512 spans, LLM spans tens of KiB each), add_many_spans or enqueue_many_rollouts,
# each of whose items must fit one Kafka record (1 MiB). 64 MiB holds 512 spans of 128 KiB.
MAX_BODY = 64 * 1024 * 1024


class BodyRefused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class StoreGuard:
    """Bounded (and inflated) bodies and bare 500s for every HTTP request of `app`."""

    def __init__(self, app: ASGIApp, max_body: int = MAX_BODY) -> None:
        self.app = app
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await self._body(scope, receive)
            if body is None:
                return  # the client went away
            body = self._inflated(scope, body)
        except BodyRefused as exc:
            await _answer(send, exc.status, {"detail": exc.message})
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # (a disconnect, for a streaming answer)

        guarded = _Guarded(scope, send)
        try:
            await self.app(scope, replay, guarded.send)
        except Exception as exc:
            if guarded.started:
                raise  # the answer has begun: nothing more can be said
            error_id, message = unexpected(scope["method"], scope["path"], exc)
            await _answer(send, 500, {"detail": message}, error_id)

    async def _body(self, scope: Scope, receive: Receive) -> bytes | None:
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise BodyRefused(413, self._too_large())
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise BodyRefused(413, self._too_large())
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _inflated(self, scope: Scope, body: bytes) -> bytes:
        encoding = (_header(scope, b"content-encoding") or "").strip().lower()
        if encoding != "gzip":
            return body
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            plain = inflater.decompress(body, self.max_body + 1)
        except zlib.error as exc:
            message = f"the body is not gzip, as its Content-Encoding says: {exc}"
            raise BodyRefused(400, message) from None
        if len(plain) > self.max_body or inflater.unconsumed_tail:
            raise BodyRefused(413, self._too_large(" inflated"))
        scope["headers"] = [
            (name, value)
            for name, value in scope["headers"]
            if name.lower() not in (b"content-encoding", b"content-length")
        ] + [(b"content-length", str(len(plain)).encode())]
        return plain

    def _too_large(self, how: str = "") -> str:
        return (
            f"the request body is too large{how}: this store takes at most "
            f"{self.max_body:,} bytes a request"
        )


class _Guarded:
    """The app's `send`, with any 500 it answers replaced by a bare one (logged with an id)."""

    def __init__(self, scope: Scope, send: Send) -> None:
        self.scope = scope
        self._send = send
        self.started = False
        self._held: list[bytes] | None = None  # the body of a 500 being replaced

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start" and message["status"] == 500:
            self._held = []
            return
        if self._held is None:
            self.started = self.started or message["type"] == "http.response.start"
            await self._send(message)
            return
        if message["type"] == "http.response.body":
            self._held.append(message.get("body", b""))
            if not message.get("more_body", False):
                said = b"".join(self._held).decode("utf-8", "replace")
                error_id, sentence = unexpected(
                    self.scope["method"], self.scope["path"], _Answered500(said[:20_000])
                )
                self.started = True
                await _answer(self._send, 500, {"detail": sentence}, error_id)


class _Answered500(Exception):
    """What the app itself answered with a 500 (its traceback, with Agent Lightning's)."""


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


async def _answer(send: Send, status: int, body: dict[str, Any], error_id: str = "") -> None:
    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    if error_id:
        headers.append((ERROR_ID_HEADER.lower().encode(), error_id.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw, "more_body": False})
