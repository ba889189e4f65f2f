"""Agent Lightning's HTTP store protocol (its LightningStoreServer: the routes its
LightningStoreClient speaks and the OTLP/HTTP traces endpoint, /v1/traces) over an
AglStreamStore, with the store's refusals answered 400 with the reason (an id that breaks the
id rule among them), an unknown rollout 404, data too large for one Kafka record 413, a body
over agl_stream.compat.agl.guard's limit 413, and anything unexpected a bare 500 with an error id
(guard.py). With a token (AGL_STREAM_API_TOKEN), every call but the health check needs it as a
bearer token, as on agl-stream's other servers; Agent Lightning's own client sends none, so
processes use `TokenStoreClient` (below), which does.

/v1/traces takes spans into any existing attempt its caller names (Agent Lightning's runners
send their agents' spans there, naming their attempt in resource attributes, with no
credential of the attempt's own), as POST /v1/agl/spans does: the store's callers are trusted
as Agent Lightning's are, which is why the token guards every route. Spans from other systems
go to `agl-stream ingest otlp` instead, which lets a span join only attempts it started
(agl_stream.otlp.mapping)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from agentlightning.store.client_server import LightningStoreClient, LightningStoreServer
from agentlightning.utils.server_launcher import PythonServerLauncherArgs
from aiokafka.errors import MessageSizeTooLargeError
from fastapi import Request
from fastapi.exceptions import ResponseValidationError
from fastapi.responses import JSONResponse, Response

from agl_stream.compat.agl.core import StoreFenced
from agl_stream.compat.agl.guard import StoreGuard
from agl_stream.compat.agl.store import AglStreamStore
from agl_stream.db.outage import DatabaseUnavailable
from agl_stream.runtime.auth import TOKEN_VARIABLE
from agl_stream.runtime.http_errors import ERROR_ID_HEADER, unexpected

HEALTH = "/v1/agl/health"
# aiokafka's default max_request_size, which the store's producer keeps: the most one record
# (a rollout with its input, an attempt, a span) can be.
RECORD_LIMIT = 1_048_576


def store_server(
    store: AglStreamStore,
    host: str,
    port: int,
    launch_mode: str = "asyncio",
    token: str | None = None,
) -> Any:
    """Agent Lightning's server over `store` (not started); port 0: a free one."""
    server = LightningStoreServer(
        store,
        launcher_args=PythonServerLauncherArgs(
            host=host,
            port=port or None,
            access_host=None if host in ("0.0.0.0", "::", "") else host,
            launch_mode=launch_mode,
            healthcheck_url=HEALTH,
        ),
    )

    async def refused(_: Request, exc: Exception) -> JSONResponse:
        # A bad request (an unknown rollout, a sort field a model lacks, a span agl-stream
        # cannot keep): the client must not retry it, so 400 with the reason, not 500.
        return JSONResponse(
            status_code=400, content={"detail": str(exc), "error_type": type(exc).__name__}
        )

    async def try_again(_: Request, exc: Exception) -> JSONResponse:
        # Fenced by a newer store, or PostgreSQL away (the store answers what its memory
        # holds, and this for what needs the read model).
        return JSONResponse(status_code=503, content={"detail": str(exc)})

    async def too_large(_: Request, exc: Exception) -> JSONResponse:
        message = (
            "the request's data does not fit one Kafka record, which holds at most "
            f"{RECORD_LIMIT:,} bytes: send a smaller input, metadata or span"
        )
        return JSONResponse(status_code=413, content={"detail": message})

    server.app.add_exception_handler(ValueError, refused)
    server.app.add_exception_handler(TypeError, refused)
    server.app.add_exception_handler(StoreFenced, try_again)
    server.app.add_exception_handler(DatabaseUnavailable, try_again)
    server.app.add_exception_handler(MessageSizeTooLargeError, too_large)
    server.app.add_exception_handler(ResponseValidationError, _not_found)
    if token is not None:
        server.app.middleware("http")(_bearer_check(token))
    server.app.add_middleware(StoreGuard)  # outermost: it sees what the token check answers too
    return server


async def _not_found(request: Request, exc: Exception) -> JSONResponse:
    """An answer its route's model refuses: None where a rollout was asked for by id is a
    rollout that does not exist (404); anything else is a fault of the server's (500)."""
    assert isinstance(exc, ResponseValidationError)
    rollout_id = request.path_params.get("rollout_id")
    if exc.body is None and request.method == "GET" and rollout_id is not None:
        return JSONResponse(
            status_code=404, content={"detail": f"rollout {rollout_id!r} does not exist"}
        )
    error_id, message = unexpected(request.method, request.url.path, exc)
    return JSONResponse(
        status_code=500, content={"detail": message}, headers={ERROR_ID_HEADER: error_id}
    )


def _bearer_check(
    token: str,
) -> Callable[[Request, Callable[[Request], Awaitable[Response]]], Awaitable[Response]]:
    async def check(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if request.url.path.endswith("/health"):
            return await call_next(request)
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), token.encode()
        ):
            return await call_next(request)
        message = (
            "this store needs a bearer token: send 'Authorization: Bearer <token>' with the "
            f"token of {TOKEN_VARIABLE} (agl_stream.compat.agl.TokenStoreClient does)"
        )
        return JSONResponse(
            status_code=401, content={"detail": message},
            headers={"WWW-Authenticate": 'Bearer realm="agl-stream"'},
        )  # fmt: skip

    return check


class TokenStoreClient(LightningStoreClient):  # type: ignore[misc]
    """Agent Lightning's LightningStoreClient that sends a bearer token with every call (for
    an `agl-stream store` started with AGL_STREAM_API_TOKEN)."""

    def __init__(self, server_address: str, token: str, **options: Any) -> None:
        super().__init__(server_address, **options)
        self._token = token

    async def _get_session(self) -> aiohttp.ClientSession:
        session: aiohttp.ClientSession = await super()._get_session()
        session.headers["Authorization"] = f"Bearer {self._token}"
        return session

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_token": self._token}

    def __setstate__(self, state: dict[str, Any]) -> None:
        token = state.pop("_token")
        super().__setstate__(state)
        self._token = token
