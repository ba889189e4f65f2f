"""What the HTTP servers answer when a request goes wrong, without a broker: agl_stream.
http_errors' aiohttp guard (4xx with a reason, a bare 500 with an error id whose traceback is
in the log, bodies over the limit 413, ids by the id rule) and the store facade's ASGI guard
(bounded and inflated bodies, Agent Lightning's traceback answers replaced)."""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import AsyncIterator

import aiohttp
import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from agl_stream.compat.agl.guard import Receive, Scope, Send, StoreGuard
from agl_stream.runtime import http_errors
from agl_stream.runtime.http_errors import ERROR_ID_HEADER, Refused

SECRET = "/home/agl/secret_module.py"


async def _fails(_: web.Request) -> web.Response:
    raise RuntimeError(f"boom in {SECRET}")


async def _refuses(_: web.Request) -> web.Response:
    raise Refused(409, "that rollout has ended")


async def _reads(request: web.Request) -> web.Response:
    return web.json_response({"size": len(await request.read())})


async def _reads_a_little(request: web.Request) -> web.Response:
    body = await http_errors.read_body(request, 10, "this route")
    return web.json_response({"size": len(body)})


async def _by_id(request: web.Request) -> web.Response:
    return web.json_response({"id": http_errors.path_id(request, "rollout", "the rollout id")})


async def _fails_mid_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    await response.prepare(request)
    await response.write(b"data: 1\n\n")
    raise RuntimeError(f"boom in {SECRET}")


@pytest.fixture
async def server() -> AsyncIterator[str]:
    app = web.Application(client_max_size=1000)
    http_errors.install(app)
    app.router.add_get("/fails", _fails)
    app.router.add_get("/refuses", _refuses)
    app.router.add_post("/reads", _reads)
    app.router.add_post("/reads-a-little", _reads_a_little)
    app.router.add_get("/rollouts/{rollout}", _by_id)
    app.router.add_get("/stream", _fails_mid_stream)
    async with TestServer(app) as test_server:
        yield str(test_server.make_url("")).rstrip("/")


async def test_an_unexpected_error_is_a_bare_500_with_an_id_in_the_log(
    server: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, "agl_stream.http")
    async with aiohttp.ClientSession() as http, http.get(f"{server}/fails") as r:
        assert r.status == 500
        text = await r.text()
        error_id = r.headers[ERROR_ID_HEADER]
    assert error_id in text and "Traceback" not in text and SECRET not in text
    assert json.loads(text)["error"]["type"] == "server_error"
    (record,) = [r for r in caplog.records if error_id in r.getMessage()]
    assert record.exc_info is not None and SECRET in str(record.exc_info[1])


async def test_refusals_are_4xx_with_their_reason(server: str) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{server}/refuses") as r:
            assert r.status == 409
            assert (await r.json())["error"]["message"] == "that rollout has ended"
        async with http.get(f"{server}/nowhere") as r:  # aiohttp's own 404, as JSON
            assert r.status == 404 and "Not Found" in (await r.json())["error"]["message"]
        async with http.post(f"{server}/fails") as r:
            assert r.status == 405 and "GET" in r.headers["Allow"]
        async with http.get(f"{server}/rollouts/ro%00x") as r:
            assert r.status == 400
            message = (await r.json())["error"]["message"]
            assert message.startswith("the rollout id must hold printable characters only")
        async with http.get(f"{server}/rollouts/{'r' * 257}") as r:
            assert r.status == 400 and "at most 256" in (await r.json())["error"]["message"]
        async with http.get(f"{server}/rollouts/ro-1") as r:
            assert r.status == 200 and (await r.json()) == {"id": "ro-1"}


async def test_bodies_over_the_limit_are_413_inflated_or_not(server: str) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server}/reads", data=b"x" * 1000) as r:
            assert r.status == 200 and (await r.json()) == {"size": 1000}
        async with http.post(f"{server}/reads", data=b"x" * 1001) as r:
            assert r.status == 413
            assert "too large" in (await r.json())["error"]["message"]
        bomb = gzip.compress(b"\0" * 100_000)  # 100 bytes on the wire
        headers = {"Content-Encoding": "gzip"}
        async with http.post(f"{server}/reads", data=bomb, headers=headers) as r:
            assert r.status == 413
        async with http.post(f"{server}/reads-a-little", data=b"x" * 11) as r:
            assert r.status == 413
            assert "this route takes a body of at most 10 bytes" in await r.text()
        async with http.post(f"{server}/reads-a-little", data=b"x" * 10) as r:
            assert r.status == 200


async def test_a_stream_that_fails_midway_is_cut_and_logged(
    server: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, "agl_stream.http")
    async with aiohttp.ClientSession() as http, http.get(f"{server}/stream") as r:
        assert r.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.read()
    assert any("error " in r.getMessage() for r in caplog.records)
    async with aiohttp.ClientSession() as http, http.get(f"{server}/refuses") as r:
        assert r.status == 409  # and the server goes on


# ---- the store facade's ASGI guard ---------------------------------------------------------


async def _asgi_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Echoes the body's size; /traceback answers as Agent Lightning does; /raise raises."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/raise":
        raise RuntimeError(f"boom in {SECRET}")
    status, payload = (
        200,
        {"size": len(body), "encoding": dict(scope["headers"]).get(b"content-encoding")},
    )
    if scope["path"] == "/traceback":
        status, payload = 500, {"traceback": f"Traceback (most recent call last):\n  {SECRET}"}
    raw = json.dumps(payload, default=str).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})  # fmt: skip
    await send({"type": "http.response.body", "body": raw})


async def test_the_store_guard_bounds_inflates_and_hides(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, "agl_stream.http")
    guard = StoreGuard(_asgi_app, max_body=1000)
    transport = httpx.ASGITransport(app=guard)
    async with httpx.AsyncClient(transport=transport, base_url="http://store") as http:
        r = await http.post("/echo", content=b"x" * 1000)
        assert r.status_code == 200 and r.json()["size"] == 1000
        r = await http.post("/echo", content=b"x" * 1001)
        assert r.status_code == 413 and "at most 1,000 bytes" in r.json()["detail"]
        zipped = {"Content-Encoding": "gzip"}
        r = await http.post("/echo", content=gzip.compress(b"y" * 900), headers=zipped)
        assert r.status_code == 200 and r.json() == {"size": 900, "encoding": None}
        r = await http.post("/echo", content=gzip.compress(b"\0" * 100_000), headers=zipped)
        assert r.status_code == 413 and "inflated" in r.json()["detail"]
        r = await http.post("/echo", content=b"not gzip", headers=zipped)
        assert r.status_code == 400 and "not gzip" in r.json()["detail"]
        for path in ("/traceback", "/raise"):
            r = await http.get(path)
            assert r.status_code == 500, path
            assert "Traceback" not in r.text and SECRET not in r.text
            error_id = r.headers[ERROR_ID_HEADER]
            assert error_id in r.json()["detail"]
            logged = [x for x in caplog.records if error_id in x.getMessage()]
            assert logged and logged[0].exc_info is not None
            assert SECRET in str(logged[0].exc_info[1])
