"""Agent Lightning's HTTP store protocol (its LightningStoreServer: the routes its
LightningStoreClient speaks and the OTLP/HTTP traces endpoint, /v1/traces) over an
AglStreamStore, with the store's refusals answered 400 with the reason."""

from __future__ import annotations

from typing import Any

from agentlightning.store.client_server import LightningStoreServer
from agentlightning.utils.server_launcher import PythonServerLauncherArgs
from fastapi import Request
from fastapi.responses import JSONResponse

from agl_stream.agl.core import StoreFenced
from agl_stream.agl.store import AglStreamStore

HEALTH = "/v1/agl/health"


def store_server(store: AglStreamStore, host: str, port: int, launch_mode: str = "asyncio") -> Any:
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
    return server
