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

from agl_stream.config import DatabaseSettings, KafkaSettings
from agl_stream.dashboard.openapi import ROUTES
from agl_stream.dashboard.server import Dashboard
from agl_stream.events import PromptTemplate, RolloutMode
from agl_stream.queries import ReadModel
from agl_stream.resources import Change, publish_resources
from tests.integration.projection import projector_in_process
from tests.integration.runs import queue, runner_in_process


@pytest.fixture
async def dashboard(database: DatabaseSettings) -> AsyncIterator[str]:
    server = Dashboard(database)
    url = await server.start()
    try:
        yield url
    finally:
        await server.stop()


async def get(http: aiohttp.ClientSession, url: str, **params: Any) -> tuple[int, Any]:
    async with http.get(url, params=params) as response:
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
        _, found = await get(http, f"{dashboard}/api/rollouts", id=val)
        assert [r["rollout_id"] for r in found["items"]] == [val]
        _, found = await get(http, f"{dashboard}/api/rollouts", id="ro-nope")
        assert found["items"] == []

        status, detail = await get(http, f"{dashboard}/api/rollouts/{val}")
        assert status == 200
        assert detail["rollout"]["mode"] == "val"
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
        for path in spec["paths"].values():
            schema = path["get"]["responses"]["200"]["content"]
            assert schema, path
        async with http.get(f"{dashboard}/") as response:
            page = await response.text()
        assert response.status == 200
        assert '<script src="/static/app.js">' in page
        for asset in ("app.js", "style.css"):
            async with http.get(f"{dashboard}/static/{asset}") as response:
                assert response.status == 200
        assert "http" not in page.replace("http-equiv", "")  # nothing from another host
