"""The dashboard's web server: the page (static files shipped in the package, nothing from a
CDN), the JSON API of `openapi.ROUTES`, its OpenAPI document and the live event stream."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

from aiohttp import web

from agl_stream.dashboard import actions, api
from agl_stream.dashboard.live import Changes
from agl_stream.dashboard.openapi import ROUTES, document
from agl_stream.queries import ReadModel
from agl_stream.runtime import auth, http_errors
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings
from agl_stream.runtime.http import Listening

STATIC = Path(__file__).parent / "static"


def make_app(
    model: ReadModel, changes: Changes, kafka: KafkaSettings, token: str | None
) -> web.Application:
    app = web.Application(middlewares=[api.errors], client_max_size=actions.MAX_BODY)
    # With a token: the API needs it as a bearer token; a browser signs in at /login once
    # (its cookie then reaches the API and the event stream). The description stays open.
    auth.protect(app, token, open_paths=auth.OPEN_PATHS | {"/api/openapi.json"}, login=True)
    auth.add_login(app, token)
    http_errors.install(app, api.error_shape)
    app[api.READ_MODEL] = model
    app[api.KAFKA] = kafka
    app[api.ACTIONS] = bool(token)
    for route in ROUTES:
        app.router.add_route(route.method.upper(), route.path, route.handler)
    spec = document()

    async def openapi(request: web.Request) -> web.Response:
        return web.json_response(spec)

    async def index(request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "index.html")

    app.router.add_get("/api/openapi.json", openapi)
    app.router.add_get("/api/live", changes.stream)
    app.router.add_get("/", index)
    app.router.add_static("/static", STATIC)
    return app


class Dashboard:
    """The server, started and stopped around a read model of its own."""

    def __init__(
        self,
        database: DatabaseSettings,
        kafka: KafkaSettings,
        read_model: str | None = None,
        token: str | None = None,
    ) -> None:
        self.database = database
        self.kafka = kafka
        self.read_model = read_model
        self.token = token
        self.url = ""
        self._listening: Listening | None = None
        self._changes = Changes(database)
        self._resources = AsyncExitStack()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        model = await self._resources.enter_async_context(
            ReadModel.open(self.database, self.read_model)
        )
        await self._changes.start()
        app = make_app(model, self._changes, self.kafka, self.token)
        self._listening = await Listening.start(app, host, port)
        self.url = self._listening.url
        return self.url

    async def stop(self) -> None:
        self._changes.close_pages()  # the live streams end, so the server need not wait
        if self._listening is not None:
            await self._listening.stop()
        await self._changes.stop()
        await self._resources.aclose()
