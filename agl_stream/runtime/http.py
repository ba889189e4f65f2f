"""One lifecycle for agl-stream's aiohttp servers (gateway, OTLP receiver, policy server,
dashboard, workers' metrics): an app that refuses bodies over its limit, checks the bearer
token and answers errors through the guard, listening on host:port until it is stopped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from agl_stream.runtime import auth, http_errors


def guarded_app(
    max_body: int,
    token: str | None,
    shape: http_errors.Shape = http_errors.openai_error,
    **token_options: Any,
) -> web.Application:
    """An app with the token rule (agl_stream.runtime.auth: every path but /health needs the
    token, when there is one) and the error guard in front of its routes."""
    app = web.Application(client_max_size=max_body)
    auth.protect(app, token, **token_options)
    http_errors.install(app, shape)
    return app


@dataclass
class Listening:
    """An app listening on host:port (port 0: any free one), at `url`, until stop()."""

    runner: web.AppRunner
    url: str
    port: int

    @classmethod
    async def start(cls, app: web.Application, host: str, port: int) -> Listening:
        """Raises OSError (the port is taken, the address is not this machine's) with
        nothing left listening."""
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError:
            await runner.cleanup()
            raise
        bound = int(runner.addresses[0][1])
        return cls(runner, f"http://{host}:{bound}", bound)

    async def stop(self) -> None:
        """Stop listening, let requests in flight finish, close the app."""
        await self.runner.cleanup()
