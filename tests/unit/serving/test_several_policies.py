"""One policy server for several policies (torch engine, real tiny models): each call goes to
the policy its `model` names and is answered by that policy's weights; a version another
policy's trainer published, which holds this policy's checkpoint unchanged, neither reloads
it nor holds its calls back; a model not served is a 404 that lists those served."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agl_stream.commands.resources import ResourceCache
from agl_stream.events import Checkpoint, ResourcesPublished
from agl_stream.gateway.routes import RESOURCES_HEADER
from agl_stream.serving.engine import Job, generate
from agl_stream.serving.server import PolicyServer
from agl_stream.training.model import content_hash, initial_policy, save_policy

PROMPT = "<bos> a b"


def saved(tmp_path: Path, seed: int) -> Checkpoint:
    directory = tmp_path / f"seed{seed}"
    save_policy(initial_policy("tiny", seed=seed), directory)
    return Checkpoint(uri=directory.as_uri(), content_hash=content_hash(directory))


def answered_by(seed: int, choice: dict[str, Any]) -> bool:
    """Whether the tiny model of `seed` gives this answer (greedy: its tokens and logprobs)."""
    job = Job(choice["prompt_token_ids"], 4, 0.0, None, lambda token, logprob: None)
    generate(initial_policy("tiny", seed=seed).model, [job], pad_id=0, eos_id=None)
    logprobs = choice["logprobs"]["token_logprobs"]
    return job.token_ids == choice["token_ids"] and job.logprobs == pytest.approx(
        logprobs, abs=1e-4
    )


async def serving(server: PolicyServer, wanted: dict[str, str]) -> None:
    """Until each policy serves the version `wanted` names for it."""

    def now() -> dict[str, str | None]:
        return {
            name: (lane.engine.serving.resources_id if lane.engine.serving else None)
            for name, lane in server.lanes.items()
        }

    while now() != wanted:
        await asyncio.wait_for(server._moved.wait(), 30)


async def test_each_call_is_answered_by_the_policy_it_names(tmp_path: Path) -> None:
    speaker, listener, speaker_2 = saved(tmp_path, 1), saved(tmp_path, 2), saved(tmp_path, 3)
    cache = ResourceCache()
    server = PolicyServer(policies=("speaker", "listener"))
    following = asyncio.create_task(server.follow(cache))
    url = await server.start("127.0.0.1", 0)

    async def call(session: aiohttp.ClientSession, model: str, **headers: str) -> Any:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as answer:
            return answer.status, await answer.json()

    try:
        joint = {"speaker": speaker, "listener": listener}
        cache.apply(ResourcesPublished(resources_id="joint-v1", version=1, resources=joint))
        await serving(server, {"speaker": "joint-v1", "listener": "joint-v1"})
        async with aiohttp.ClientSession() as session:
            answers = {model: await call(session, model) for model in ("speaker", "listener")}
            for model, seed in (("speaker", 1), ("listener", 2)):
                status, body = answers[model]
                choice = body["choices"][0]
                assert status == 200 and body["model"] == model
                assert answered_by(seed, choice) and not answered_by(3 - seed, choice)

            status, body = await call(session, "policy")
            assert status == 404
            assert body["error"]["message"] == (
                "the model 'policy' is not served here; the policies served are listener, speaker"
            )
            async with session.get(f"{url}/v1/models") as models:
                assert [m["id"] for m in (await models.json())["data"]] == ["speaker", "listener"]

            # The speaker's trainer publishes on top: the listener's checkpoint is unchanged.
            mine = {"speaker": speaker_2, "listener": listener}
            cache.apply(
                ResourcesPublished(resources_id="run-speaker-v2", version=2, resources=mine)
            )
            await serving(server, {"speaker": "run-speaker-v2", "listener": "joint-v1"})
            status, body = await call(session, "listener", **{RESOURCES_HEADER: "run-speaker-v2"})
            assert status == 200 and body["system_fingerprint"] == "joint-v1"
            assert server.counts["catch_up_waits"] == 0  # its policy is the same: no wait
            status, body = await call(session, "speaker")
            choice = body["choices"][0]
            assert body["system_fingerprint"] == "run-speaker-v2"
            assert answered_by(3, choice)

            async with session.get(f"{url}/health") as health:
                state = await health.json()
            assert health.status == 200
            assert state["policies"] == {
                "speaker": {"resources_id": "run-speaker-v2", "refused": {}},
                "listener": {"resources_id": "joint-v1", "refused": {}},
            }
            assert server.reloads == 1  # the speaker's second version; first loads are none
    finally:
        following.cancel()
        await server.stop()


async def test_a_policy_that_cannot_load_leaves_the_others_serving(tmp_path: Path) -> None:
    """A version whose listener checkpoint is broken is refused for the listener, with the
    reason in /health, and the speaker serves it; /health is 503 until each policy serves."""
    speaker = saved(tmp_path, 1)
    broken = Checkpoint(uri=(tmp_path / "missing").as_uri(), content_hash="sha256:" + "0" * 64)
    cache = ResourceCache()
    server = PolicyServer(policies=("speaker", "listener"))
    following = asyncio.create_task(server.follow(cache))
    url = await server.start("127.0.0.1", 0)
    try:
        joint = {"speaker": speaker, "listener": broken}
        cache.apply(ResourcesPublished(resources_id="joint-v1", version=1, resources=joint))
        while "joint-v1" not in server.lanes["listener"].refused:
            await asyncio.wait_for(server._moved.wait(), 30)
        await serving(server, {"speaker": "joint-v1", "listener": None})  # type: ignore[dict-item]
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/health") as health:
                state = await health.json()
            assert health.status == 503
            assert state["policies"]["speaker"] == {"resources_id": "joint-v1", "refused": {}}
            assert "joint-v1" in state["policies"]["listener"]["refused"]
            body = {"model": "listener", "prompt": PROMPT, "max_tokens": 2}
            async with session.post(f"{url}/v1/completions", json=body) as answer:
                assert answer.status == 503  # nothing of the listener's is served yet
    finally:
        following.cancel()
        await server.stop()
