"""The policy server's pure parts and its engine: requests checked, prompts rendered, stream
deltas that join to the whole text, and batched generation equal to one at a time."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_stream.commands.resources import ResourceCache
from agl_stream.events import Checkpoint, ResourcesPublished
from agl_stream.gateway.routes import RESOURCES_HEADER
from agl_stream.gateway.wire import CallKind
from agl_stream.serving.api import Detokenizer, InvalidRequest, read_generation, render_prompt
from agl_stream.serving.engine import Job, generate
from agl_stream.serving.server import PolicyServer
from agl_stream.training.model import content_hash, initial_policy, save_policy, tiny_chat_policy
from tests.support.scrape import scrape, unlabelled

POLICY = tiny_chat_policy(seed=1)


@pytest.mark.parametrize(
    ("kind", "body", "message"),
    [
        (CallKind.CHAT, {"messages": []}, "messages must be a non-empty list"),
        (CallKind.CHAT, {"messages": [{"role": "user"}]}, "string content"),
        (CallKind.COMPLETION, {"prompt": ["a", "b"]}, "prompt must be a string"),
        (CallKind.COMPLETION, {"prompt": "x", "n": 2}, "n must be"),
        (CallKind.COMPLETION, {"prompt": "x", "temperature": "hot"}, "temperature must be"),
        (CallKind.COMPLETION, {"prompt": "x", "max_tokens": 10_000}, "max_tokens must be"),
        (CallKind.COMPLETION, {"prompt": "x", "stop": ["\n"]}, "stop sequences"),
        (CallKind.COMPLETION, {"prompt": "x", "seed": 1.5}, "seed must be an integer"),
    ],
)
def test_bad_requests_name_the_field(kind: CallKind, body: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        read_generation(kind, body, context_length=256)


def test_chat_prompts_use_the_tokenizers_template() -> None:
    generation = read_generation(
        CallKind.CHAT, {"messages": [{"role": "user", "content": "hi"}]}, 256
    )
    assert render_prompt(POLICY.tokenizer, generation) == "<|user|>hi<|end|><|assistant|>"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(POLICY.tokenizer) - 1), max_size=30))
def test_stream_deltas_join_to_the_whole_text(ids: list[int]) -> None:
    """Byte tokens split characters (UTF-8): deltas wait for whole ones and still add up."""
    detokenizer = Detokenizer(POLICY.tokenizer, skip_special_tokens=True)
    text = "".join(detokenizer.push(i) for i in ids) + detokenizer.finish()
    assert text == POLICY.tokenizer.decode(ids, skip_special_tokens=True)


def test_batched_generation_equals_one_request_at_a_time() -> None:
    """Left padding, masks and positions right: a batch of prompts of different lengths
    gives each the tokens and logprobs it gets alone (greedy)."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15]]

    def jobs() -> list[Job]:
        return [Job(p, 6, 0.0, None, lambda t, lp: None) for p in prompts]

    batched = jobs()
    generate(POLICY.model, batched, pad_id=0, eos_id=None)
    for prompt, together in zip(prompts, batched, strict=True):
        (alone,) = [Job(prompt, 6, 0.0, None, lambda t, lp: None)]
        generate(POLICY.model, [alone], pad_id=0, eos_id=None)
        assert together.token_ids == alone.token_ids
        assert together.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_seeded_sampling_repeats_and_stops_at_its_limit() -> None:
    first, second = (Job([5, 6], 8, 1.0, 42, lambda t, lp: None) for _ in range(2))
    generate(POLICY.model, [first], pad_id=0, eos_id=None)
    generate(POLICY.model, [second, Job([9], 3, 1.0, None, lambda t, lp: None)], 0, None)
    assert first.token_ids == second.token_ids and len(first.token_ids) == 8
    assert first.finish_reason == "length"


async def test_a_call_on_a_newer_version_waits_for_its_load_and_is_answered_by_it(
    tmp_path: Path,
) -> None:
    """On-policy: an attempt that ran on version v2 calls before the server has v2; the call
    waits until v2 is folded and loaded, and v2 answers."""
    cache = ResourceCache()

    def version(n: int) -> ResourcesPublished:
        directory = tmp_path / f"v{n}"
        save_policy(initial_policy("tiny", seed=n), directory)
        checkpoint = Checkpoint(uri=directory.as_uri(), content_hash=content_hash(directory))
        return ResourcesPublished(resources_id=f"v{n}", version=n, resources={"policy": checkpoint})

    server = PolicyServer()
    following = asyncio.create_task(server.follow(cache, "policy", None))
    url = await server.start("127.0.0.1", 0)
    try:
        cache.apply(version(1))
        while server.resources_id != "v1":  # the first load (the server's own wake-up)
            await asyncio.wait_for(server._moved.wait(), 30)
        newer = version(2)
        body = {"model": "policy", "prompt": "<bos> a", "max_tokens": 2}
        async with aiohttp.ClientSession() as session:
            call = asyncio.create_task(
                session.post(f"{url}/v1/completions", json=body, headers={RESOURCES_HEADER: "v2"})
            )
            await asyncio.sleep(0.3)
            assert not call.done()  # waiting for v2, not answered by v1
            cache.apply(newer)
            async with await asyncio.wait_for(call, 5) as response:
                answer = await response.json()
        metrics = unlabelled(await scrape(f"{url}/metrics"))
        assert answer["system_fingerprint"] == "v2"
        assert server.reloads == 1
        # Its /metrics: the call, its tokens, both loads, the wait, the version served.
        assert metrics["agl_stream_policy_server_requests_total"] == 1
        assert metrics["agl_stream_policy_server_generated_tokens_total"] in (1, 2)  # max 2
        assert metrics["agl_stream_policy_server_reload_seconds_count"] == 2
        assert metrics["agl_stream_policy_server_catch_up_waits_total"] == 1
        assert metrics["agl_stream_policy_server_catch_up_seconds_sum"] >= 0.3
        assert metrics["agl_stream_policy_server_version"] == 2
    finally:
        following.cancel()
        await server.stop()
