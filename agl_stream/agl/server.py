"""Agent Lightning's HTTP store protocol (its LightningStoreServer: the routes its
LightningStoreClient speaks and the OTLP/HTTP traces endpoint, /v1/traces) over an
AglStreamStore, with the store's refusals answered 400 with the reason. With a token
(AGL_STREAM_API_TOKEN), every call but the health check needs it as a bearer token, as on
agl-stream's other servers; Agent Lightning's own client sends none, so processes use
`TokenStoreClient` (below), which does."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from agentlightning.store.client_server import LightningStoreClient, LightningStoreServer
from agentlightning.utils.server_launcher import PythonServerLauncherArgs
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from agl_stream.agl.core import StoreFenced
from agl_stream.agl.store import AglStreamStore
from agl_stream.auth import TOKEN_VARIABLE

HEALTH = "/v1/agl/health"


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

    async def fenced(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(status_code=503, content={"detail": str(exc)})

    server.app.add_exception_handler(ValueError, refused)
    server.app.add_exception_handler(TypeError, refused)
    server.app.add_exception_handler(StoreFenced, fenced)
    if token is not None:
        server.app.middleware("http")(_bearer_check(token))
    return server


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
            f"token of {TOKEN_VARIABLE} (agl_stream.agl.TokenStoreClient does)"
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
