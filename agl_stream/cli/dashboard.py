"""`agl-stream dashboard`."""

from __future__ import annotations

import asyncio

import click

from agl_stream.cli.common import (
    AppContext,
    console,
    friendly_errors,
    listening_on,
    read_model_option,
    stop_on_signals,
)
from agl_stream.runtime.auth import MIN_TOKEN_LENGTH


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True)
@read_model_option("Show")
@click.option(
    "--token",
    metavar="TOKEN",
    help="Require this bearer token for the API and allow cancel and requeue with it. "
    "[default: AGL_STREAM_API_TOKEN; none: open and read-only]",
)
@click.pass_obj
@friendly_errors
def dashboard(
    app: AppContext, /, host: str, port: int, read_model: str | None, token: str | None
) -> None:
    """Serve the dashboard: training runs with their reward curves, rollouts (filters, search
    by id, pages), a rollout's attempts and span waterfall with its LLM calls as chats,
    workers, resources versions and dead letters, updating live as the projector writes. Its
    JSON API is described at /api/openapi.json. Read-only unless it has a token: then the API
    needs it as a bearer token, a browser signs in once at /login, and cancel and requeue are
    allowed."""
    from agl_stream.dashboard.server import Dashboard

    if token is None:
        token = app.auth().token  # AGL_STREAM_API_TOKEN, as every server of the process
    elif len(token) < MIN_TOKEN_LENGTH:
        raise click.BadParameter(
            f"use at least {MIN_TOKEN_LENGTH} characters", param_hint="--token"
        )

    async def main() -> None:
        stop = stop_on_signals()
        server = Dashboard(app.database(), app.kafka(), read_model, token)
        with listening_on(f"{host}:{port}"):
            url = await server.start(host, port)
        console.print(f"dashboard on {url}/ (API: {url}/api/openapi.json)", highlight=False)
        try:
            await stop.wait()
        finally:
            await server.stop()

    asyncio.run(main())
