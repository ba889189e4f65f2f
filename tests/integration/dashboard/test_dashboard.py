"""The dashboard's JSON API and live stream over a real read model: a runner and a projector
run rollouts, a run publishes versions, and the API answers what the page shows (and a 400
naming the parameter, a 404 for an unknown rollout); the live stream says when the read model
changed, woken by the projector's commits."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from agl_stream.bus.kafka import producer
from agl_stream.commands.resources import Change, publish_resources
from agl_stream.commands.rewards import RewardSender, make_reward
from agl_stream.dashboard.openapi import ROUTES
from agl_stream.dashboard.server import Dashboard
from agl_stream.events import PromptTemplate, RolloutMode
from agl_stream.queries import ReadModel, RolloutFilter
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings
from tests.support.bad_records import foreign_record
from tests.support.helpers import eventually
from tests.support.projection import projector_in_process
from tests.support.runs import queue, runner_in_process

TOKEN = "a-token-of-sixteen-chars-or-more"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


@contextlib.asynccontextmanager
async def serving(
    database: DatabaseSettings, kafka: KafkaSettings, token: str | None = None
) -> AsyncIterator[str]:
    server = Dashboard(database, kafka, token=token)
    url = await server.start()
    try:
        yield url
    finally:
        await server.stop()


@pytest.fixture
async def dashboard(database: DatabaseSettings, kafka: KafkaSettings) -> AsyncIterator[str]:
    async with serving(database, kafka) as url:
        yield url


@pytest.fixture
async def guarded(database: DatabaseSettings, kafka: KafkaSettings) -> AsyncIterator[str]:
    """A dashboard started with a token: reads need it, and it allows cancel and requeue."""
    async with serving(database, kafka, TOKEN) as url:
        yield url


async def get(http: aiohttp.ClientSession, url: str, **params: Any) -> tuple[int, Any]:
    async with http.get(url, params=params) as response:
        return response.status, await response.json()


async def post(
    http: aiohttp.ClientSession, url: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async with http.post(url, json=body, headers=headers) as response:
        return response.status, await response.json()


async def changes(http: aiohttp.ClientSession, url: str, seen: list[str]) -> None:
    """Read the live stream, noting each `changed` event."""
    async with http.get(f"{url}/api/live") as response:
        async for line in response.content:
            if line.startswith(b"event: changed"):
                seen.append("changed")


async def publish_run(kafka: KafkaSettings, run: str, rewards: list[float]) -> None:
    for step, reward in enumerate(rewards, start=1):
        change = Change(
            resources={"prompt": PromptTemplate(template=f"step {step}: {{x}}")},
            resources_id=f"{run}-v{step}",
            metadata={
                "run_name": run,
                "step": str(step),
                "mean_reward": str(reward),
                "samples": "64",
            },
        )
        await publish_resources(kafka, change, published_by="test")


async def test_the_api_answers_what_the_page_shows(
    kafka: KafkaSettings, database: DatabaseSettings, dashboard: str
) -> None:
    seen: list[str] = []
    async with aiohttp.ClientSession() as http:
        live = asyncio.create_task(changes(http, dashboard, seen))
        try:
            async with projector_in_process(kafka, database), runner_in_process(kafka):
                train = await queue(
                    kafka, [{"reward": 0.5}, {"reward": 1.0}], metadata={"batch": "7"}
                )
                (val,) = await queue(kafka, [{"reward": 0.25}], mode=RolloutMode.VAL)
                await publish_run(kafka, "grpo-a", [0.2, 0.4, 0.7])
                async with ReadModel.open(database) as model:
                    await model.wait_for_rollouts([*train, val], within=60)
                    async with RewardSender(kafka) as sender:  # a thumbs-up, later
                        await sender.send_event(make_reward(val, 1.0, name="thumbs", source="app"))

                    async def rewarded() -> bool:
                        return len(await model.rewards(val)) == 1

                    await eventually(rewarded, 30, "the late reward projected")
                    await asyncio.sleep(1.5)  # a heartbeat of each worker after that

                    async def versions() -> bool:
                        return len(await model.run_versions()) == 3

                    for _ in range(100):
                        if await versions():
                            break
                        await asyncio.sleep(0.1)
                status, overview = await get(http, f"{dashboard}/api/overview")
        finally:
            live.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await live
        # Woken by the projector's commits while the rollouts ran: no polling.
        assert "changed" in seen

        assert status == 200
        assert overview["status_counts"] == {"succeeded": 3}
        assert overview["workers_alive"].keys() >= {"runner", "projector"}

        status, page = await get(
            http, f"{dashboard}/api/rollouts", status="succeeded", mode="train"
        )
        assert status == 200
        assert sorted(r["rollout_id"] for r in page["items"]) == sorted(train)
        assert sorted(r["reward"] for r in page["items"]) == [0.5, 1.0]
        _, page = await get(http, f"{dashboard}/api/rollouts", metadata="batch=7", limit="1")
        assert len(page["items"]) == 1
        assert page["next_cursor"] is not None  # keyset pages
        _, rest = await get(
            http,
            f"{dashboard}/api/rollouts",
            metadata="batch=7",
            limit="1",
            cursor=page["next_cursor"],
        )
        assert {page["items"][0]["rollout_id"], rest["items"][0]["rollout_id"]} == set(train)

        status, detail = await get(http, f"{dashboard}/api/rollouts/{val}")
        assert status == 200
        assert detail["rollout"]["mode"] == "val"
        [late] = detail["rewards"]
        assert (late["name"], late["value"], late["source"]) == ("thumbs", 1.0, "app")
        [attempt] = detail["attempts"]
        assert attempt["status"] == "succeeded"
        status, spans = await get(http, f"{dashboard}/api/rollouts/{val}/spans")
        assert status == 200
        assert len(spans) == attempt["span_count"]
        assert {"agl.attempt", "agl.message", "agl.reward"} <= {s["name"] for s in spans}

        status, runs = await get(http, f"{dashboard}/api/runs")
        [run] = runs
        assert (run["name"], run["algorithm"], run["latest_reward"]) == ("grpo-a", "grpo", 0.7)
        assert [(p["step"], p["reward"]) for p in run["points"]] == [(1, 0.2), (2, 0.4), (3, 0.7)]
        assert run["points"][0]["counts"] == {"samples": 64}
        _, versions = await get(http, f"{dashboard}/api/resources", name="prompt")
        assert [v["resources_id"] for v in versions] == ["grpo-a-v3", "grpo-a-v2", "grpo-a-v1"]
        _, workers = await get(http, f"{dashboard}/api/workers")
        assert {w["role"] for w in workers} >= {"runner", "projector"}


async def test_bad_requests_say_what_is_wrong(dashboard: str) -> None:
    async with aiohttp.ClientSession() as http:
        for params, expected in [
            ({"status": "done"}, "status"),
            ({"limit": "0"}, "limit"),
            ({"since": "yesterday"}, "since"),
            ({"colour": "red"}, "unknown parameter 'colour'"),
            ({"cursor": "garbage"}, "cursor"),
        ]:
            status, body = await get(http, f"{dashboard}/api/rollouts", **params)
            assert status == 400, params
            assert expected in body["error"], (params, body)
        status, body = await get(http, f"{dashboard}/api/rollouts/ro-missing")
        assert status == 404
        assert "ro-missing" in body["error"]
        status, body = await get(http, f"{dashboard}/api/rollouts/ro-missing/spans")
        assert status == 404
        status, body = await get(http, f"{dashboard}/api/resources", limit="many")
        assert status == 400
        assert "limit must be a whole number" in body["error"]


async def test_the_page_and_its_openapi_description_are_served(dashboard: str) -> None:
    async with aiohttp.ClientSession() as http:
        status, spec = await get(http, f"{dashboard}/api/openapi.json")
        assert status == 200
        assert set(spec["paths"]) == {r.path for r in ROUTES} | {"/api/live"}
        for route in ROUTES:
            operation = spec["paths"][route.path][route.method]
            assert operation["responses"][str(route.ok)]["content"], route.path
        async with http.get(f"{dashboard}/") as response:
            page = await response.text()
        assert response.status == 200
        assert '<script src="/static/app.js">' in page
        for asset in ("app.js", "style.css"):
            async with http.get(f"{dashboard}/static/{asset}") as response:
                assert response.status == 200
        assert "http" not in page.replace("http-equiv", "")  # nothing from another host


async def test_dead_letters_are_shown_with_their_reason(
    kafka: KafkaSettings, database: DatabaseSettings, dashboard: str
) -> None:
    async with aiohttp.ClientSession() as http:
        status, letters = await get(http, f"{dashboard}/api/dead-letters")
        assert (status, letters) == (200, [])
        async with projector_in_process(kafka, database), producer(kafka) as client:
            await client.send_and_wait(kafka.topic("spans"), foreign_record(), key=b"ro-x")
            await client.send_and_wait(kafka.topic("spans"), b"not avro at all", key=b"ro-y")

            async def two() -> bool:
                return len((await get(http, f"{dashboard}/api/dead-letters"))[1]) == 2

            await eventually(two, 30, "two dead letters")
        status, letters = await get(http, f"{dashboard}/api/dead-letters", limit="10")
        assert status == 200
        assert letters[0]["dlq_offset"] > letters[1]["dlq_offset"]  # newest first
        by_kind = {x["kind"]: x for x in letters}
        foreign, garbage = by_kind["unknown_schema"], by_kind["not_single_object"]
        assert foreign["source_topic"] == garbage["source_topic"] == kafka.topic("spans")
        assert "fingerprint" in foreign["reason"]
        assert garbage["preview"] == "not avro at all" and garbage["event"] is None
        status, body = await get(http, f"{dashboard}/api/dead-letters", limit="5000")
        assert status == 400 and "limit must be between 1 and 1000" in body["error"]


async def test_a_token_guards_reads_and_allows_actions(
    kafka: KafkaSettings, database: DatabaseSettings, guarded: str, dashboard: str
) -> None:
    # unsafe: keep cookies of an IP address (127.0.0.1), as a browser does
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        async with http.get(f"{guarded}/api/overview") as response:
            assert response.status == 401
            assert response.headers["WWW-Authenticate"].startswith("Bearer")
            assert "Authorization: Bearer" in (await response.json())["error"]["message"]
        async with http.get(f"{guarded}/api/overview", headers=BEARER) as response:
            assert response.status == 200
            assert (await response.json())["actions"] is True
        wrong = {"Authorization": "Bearer " + "x" * len(TOKEN)}
        async with http.get(f"{guarded}/api/rollouts", headers=wrong) as response:
            assert response.status == 401
        async with http.get(f"{guarded}/api/openapi.json") as response:
            assert response.status == 200  # the description is no secret
        # A browser asking for the page is sent to sign in; then its cookie reads the API.
        async with http.get(guarded, headers={"Accept": "text/html"}) as response:
            assert response.url.path == "/login" and response.status == 200
        async with http.post(f"{guarded}/login", data={"token": "nope"}) as response:
            assert response.status == 401
        async with http.post(f"{guarded}/login", data={"token": TOKEN}) as response:
            assert response.status == 200 and response.url.path == "/"
        assert (await get(http, f"{guarded}/api/overview"))[0] == 200
        # ... but a cookie alone never acts: another site could make a browser send it.
        status, body = await post(http, f"{guarded}/api/rollouts/ro-x/cancel")
        assert status == 403 and "X-AGL-Dashboard" in body["error"]
        page = {"X-AGL-Dashboard": "1"}
        status, body = await post(http, f"{guarded}/api/rollouts/ro-x/cancel", headers=page)
        assert status == 404 and "ro-x" in body["error"]
        status, body = await post(http, f"{guarded}/api/rollouts/ro-x/cancel", headers=BEARER)
        assert status == 404

    async with aiohttp.ClientSession() as http:  # no token configured: open and read-only
        _, overview = await get(http, f"{dashboard}/api/overview")
        assert overview["actions"] is False
        for action in ("cancel", "requeue"):
            status, body = await post(http, f"{dashboard}/api/rollouts/ro-x/{action}")
            assert status == 403 and "read-only: start it with --token" in body["error"]


async def test_cancel_and_requeue_from_the_dashboard(
    kafka: KafkaSettings, database: DatabaseSettings, guarded: str
) -> None:
    async with (
        aiohttp.ClientSession(headers=BEARER) as http,
        projector_in_process(kafka, database),
        runner_in_process(kafka),
        ReadModel.open(database) as model,
    ):
        (failing,) = await queue(kafka, [{"fail_on_attempts": [1]}], metadata={"batch": "f"})
        (stalled,) = await queue(kafka, [{"stall": 600}])
        await model.wait_for_rollouts([failing], within=60)

        async def running() -> bool:
            return (await model.rollout(stalled)).status == "running"

        await eventually(running, 30, "the stalled rollout running")
        status, body = await post(
            http, f"{guarded}/api/rollouts/{stalled}/cancel", {"reason": "too slow"}
        )
        assert (status, body) == (
            202,
            {"rollout_id": stalled, "action": "cancel", "requeued_as": None},
        )
        await model.wait_for_rollouts([stalled], within=60)
        cancelled = await model.rollout(stalled)
        assert cancelled.status == "cancelled"
        assert "too slow" in str(cancelled.error)
        status, body = await post(http, f"{guarded}/api/rollouts/{stalled}/cancel")
        assert status == 409 and "cancelled already" in body["error"]

        assert (await model.rollout(failing)).status == "failed"
        status, first = await post(http, f"{guarded}/api/rollouts/{failing}/requeue")
        assert status == 202
        copy = first["requeued_as"]
        assert copy != failing
        status, again = await post(http, f"{guarded}/api/rollouts/{failing}/requeue")
        assert (status, again["requeued_as"]) == (202, copy)  # asked twice: one copy
        await model.wait_for_rollouts([copy], within=60)
        requeued = await model.rollout(copy)
        assert requeued.metadata == {"batch": "f", "requeued_from": failing}
        assert requeued.input == {"fail_on_attempts": [1]}
        assert requeued.status == "failed"  # it ran: the same input fails its first attempt
        page = await model.rollouts(RolloutFilter.of(metadata={"requeued_from": failing}))
        assert [r.rollout_id for r in page.items] == [copy]


async def test_the_dashboard_stops_at_once_with_pages_watching(
    database: DatabaseSettings, kafka: KafkaSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page's live stream ends when the dashboard stops: the server does not wait for the
    stream's next keep-alive to find the page gone (made an hour here, so that a stop that
    waited for it would hang)."""
    monkeypatch.setattr("agl_stream.dashboard.live.KEEPALIVE_SECONDS", 3600.0)
    server = Dashboard(database, kafka)
    url = await server.start()
    async with aiohttp.ClientSession() as http:
        watching = await http.get(f"{url}/api/live")
        assert (await watching.content.readuntil(b"\n\n")).startswith(b"retry:")
        await asyncio.wait_for(server.stop(), 60)
        assert await watching.content.read() == b""  # the stream ended, not cut
        watching.release()
