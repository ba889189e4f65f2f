"""The dashboard with a token over a real read model: its API answers 401 without the token
and 200 with it as a bearer token; a browser asking for the page is sent to /login, signs in
with the token once and then reaches the page, the API and the live stream by its cookie (an
EventSource cannot send headers); a wrong token gets no cookie."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from agl_stream.dashboard.server import Dashboard
from agl_stream.runtime.auth import COOKIE, session_value
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings

TOKEN = "dashboard-token-0123456789abcdef"


@pytest.fixture
async def dashboard(database: DatabaseSettings, kafka: KafkaSettings) -> AsyncIterator[str]:
    server = Dashboard(database, kafka, token=TOKEN)
    url = await server.start()
    try:
        yield url
    finally:
        await server.stop()


async def test_the_api_needs_the_token(dashboard: str) -> None:
    async with aiohttp.ClientSession() as http:
        for path in ("/api/runs", "/api/rollouts", "/api/dead-letters", "/api/live"):
            async with http.get(f"{dashboard}{path}") as r:
                assert r.status == 401, path
            async with http.get(
                f"{dashboard}{path}", headers={"Authorization": "Bearer wrong-0123456789abcdef"}
            ) as r:
                assert r.status == 401, path
        async with http.get(
            f"{dashboard}/api/runs", headers={"Authorization": f"Bearer {TOKEN}"}
        ) as r:
            assert r.status == 200
            assert isinstance(await r.json(), dict | list)
        async with http.get(f"{dashboard}/api/openapi.json") as r:
            assert r.status == 200  # the description is no secret


async def test_a_browser_signs_in_once(dashboard: str) -> None:
    page = {"Accept": "text/html,application/xhtml+xml"}
    # unsafe: keep cookies of an IP-address host, as a browser does (aiohttp's jar does not).
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        async with http.get(f"{dashboard}/", headers=page, allow_redirects=False) as r:
            assert r.status == 303 and r.headers["Location"] == "/login"
        async with http.get(f"{dashboard}/login") as r:
            assert r.status == 200 and 'name="token"' in await r.text()
        async with http.post(
            f"{dashboard}/login", data={"token": "wrong"}, allow_redirects=False
        ) as r:
            assert r.status == 401 and COOKIE not in r.cookies
        async with http.post(
            f"{dashboard}/login", data={"token": TOKEN}, allow_redirects=False
        ) as r:
            assert r.status == 303
            cookie = r.cookies[COOKIE]
            assert cookie.value == session_value(TOKEN) and TOKEN not in cookie.value
            assert cookie["httponly"] and cookie["samesite"] == "Strict"
        # The session's cookie jar sends it from now on.
        async with http.get(f"{dashboard}/", headers=page) as r:
            assert r.status == 200 and "<html" in (await r.text()).lower()
        async with http.get(f"{dashboard}/api/runs") as r:
            assert r.status == 200
        async with http.get(f"{dashboard}/api/live") as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
