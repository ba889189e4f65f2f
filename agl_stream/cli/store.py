"""`agl-stream store`: Agent Lightning's HTTP store protocol over agl-stream."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import click

from agl_stream.cli.common import (
    AppContext,
    console,
    fail,
    friendly_errors,
    listening_on,
    stop_on_signals,
)
from agl_stream.runtime.supervision import unless_stopped


def _check_free(host: str, port: int) -> None:
    """OSError (in use, not this machine's address) when nothing could listen there."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        # As the server binds: connections of an earlier server waiting out TIME_WAIT on
        # the port do not keep it; only a listener does.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))


def _address() -> tuple[str, int]:
    from agl_stream.compat.agl.env import EnvError, server_address

    try:
        address = server_address()
    except EnvError as exc:
        raise click.UsageError(str(exc)) from None
    return address.host, address.port


@click.command("store")
@click.option(
    "--host",
    help="Address to listen on. [default: AGL_SERVER_HOST, else the host of "
    "AGENT_LIGHTNING_STORE_URL, else 127.0.0.1]",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    help="Port to listen on (0: any free one). [default: AGL_SERVER_PORT, else the port of "
    "AGENT_LIGHTNING_STORE_URL, else 4747]",
)
@click.option(
    "--projector/--no-projector",
    default=True,
    show_default=True,
    help="Run a projector in the store's process (or rely on `worker projector`).",
)
@click.pass_obj
@friendly_errors
def store(app: AppContext, /, host: str | None, port: int | None, projector: bool) -> None:
    """Serve Agent Lightning 0.3's store protocol (what its LightningStoreClient speaks, and
    OTLP/HTTP traces at /v1/traces) backed by agl-stream's topics and read model: Agent
    Lightning's runners and algorithms given AGENT_LIGHTNING_STORE_URL (or AGL_SERVER_HOST and
    AGL_SERVER_PORT) connect unchanged, and what they record survives this process. With
    AGL_STREAM_API_TOKEN set, calls need it as a bearer token
    (agl_stream.compat.agl.TokenStoreClient sends it)."""
    default_host, default_port = _address()
    host = host or default_host
    port = default_port if port is None else port
    kafka, database = app.kafka(), app.database()
    token = app.auth().token
    # Before the store starts (it would fence a store already serving these topics), and
    # because Agent Lightning's launcher only says that the server did not start in time.
    with listening_on(f"{host}:{port}"):
        _check_free(host, port)

    async def main() -> None:
        from agl_stream.compat.agl import AglStreamStore
        from agl_stream.compat.agl.env import store_url
        from agl_stream.compat.agl.server import store_server

        stop = stop_on_signals()
        facade = AglStreamStore(kafka, database, run_projector=projector)
        try:
            # Connects, fences an earlier store, catches up. A stop asked for meanwhile, or
            # while Agent Lightning's launcher waits for its server to answer (it waits out
            # its 60 s start-up deadline when the server has stopped), stops it now.
            if await unless_stopped(facade.statistics(), stop) is None:
                return
            server = store_server(facade, host, port, token=token)
            with listening_on(f"{host}:{port}"):
                try:
                    started = await unless_stopped(_started(server), stop)
                except RuntimeError as exc:
                    fail(f"cannot serve on {host}:{port}: {exc}")
            if started is None:
                return
            url = store_url(host, int(server.endpoint.rsplit(":", 1)[1]))
            console.print(
                f"Agent Lightning store on {server.endpoint} "
                f"(AGENT_LIGHTNING_STORE_URL={url}, OTLP: {url}/v1/traces)",
                highlight=False,
            )
            try:
                await stop.wait()
            finally:
                await server.stop()
        finally:
            await facade.aclose()

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    asyncio.run(main())


async def _started(server: Any) -> bool:
    await server.start()
    return True
