"""The gateway's pure parts: attempt URLs, what is asked of an upstream, and how calls are
read out of whole responses and of streams cut at any byte."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agl_stream.agent.llm import PROMPT_JSON, RESPONSE_LOGPROBS, RESPONSE_TOKEN_IDS
from agl_stream.gateway.routes import Identity, attempt_base_url, parse_path
from agl_stream.gateway.wire import (
    BadRequest,
    CallKind,
    CallRecord,
    SSEDecoder,
    parse_request,
    prepare_request,
    read_chunk,
)

names = st.text(min_size=1, max_size=20)


@given(names, names, names)
def test_attempt_urls_round_trip_any_identity(rollout: str, attempt: str, resource: str) -> None:
    identity = Identity(rollout, attempt, resource)
    url = attempt_base_url("http://127.0.0.1:9000/", identity)
    path = url.removeprefix("http://127.0.0.1:9000") + "/chat/completions"
    assert parse_path(path) == (identity, "chat/completions")


def test_paths_without_identity_and_bad_paths() -> None:
    assert parse_path("/v1/completions") == (None, "completions")
    with pytest.raises(ValueError, match="not an OpenAI path"):
        parse_path("/chat/completions")


def test_the_upstream_is_asked_for_token_ids_and_logprobs_keeping_the_agents_choices() -> None:
    chat = prepare_request(CallKind.CHAT, {"model": "m", "messages": [], "logprobs": False})
    assert chat["return_token_ids"] is True and chat["logprobs"] is False
    completion = prepare_request(CallKind.COMPLETION, {"model": "m", "prompt": "x"})
    assert completion["logprobs"] == 0 and completion["return_token_ids"] is True


@pytest.mark.parametrize("raw", [b"", b"not json", b"[1, 2]"])
def test_bad_bodies_are_refused_with_a_reason(raw: bytes) -> None:
    with pytest.raises(BadRequest, match="JSON"):
        parse_request(raw)


CHUNKS = [
    {
        "model": "p",
        "prompt_token_ids": [1, 2],
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": "Hé"},
                "token_ids": [7, 8],
                "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}]},
            }
        ],
    },
    {
        "model": "p",
        "choices": [
            {
                "index": 0,
                "delta": {"content": "llo"},
                "token_ids": [9],
                "logprobs": {"content": [{"logprob": -1.0}]},
            }
        ],
    },
    {
        "model": "p",
        "choices": [
            {"index": 0, "delta": {"content": ""}, "token_ids": [], "finish_reason": "stop"}
        ],
    },
]


def _sse(chunks: list[dict[str, object]]) -> bytes:
    return (
        b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    )


@given(st.lists(st.integers(min_value=0, max_value=2000), max_size=8))
def test_a_stream_cut_anywhere_reads_as_the_whole_call(cuts: list[int]) -> None:
    raw = _sse(CHUNKS)
    decoder = SSEDecoder()
    record = CallRecord(
        CallKind.CHAT, {"model": "p", "messages": [{"role": "user", "content": "hi"}]}
    )
    bounds = sorted({min(c, len(raw)) for c in cuts} | {0, len(raw)})
    for start, end in itertools.pairwise(bounds):
        for event in decoder.feed(raw[start:end]):
            chunk = read_chunk(event)
            if chunk is not None:
                record.add_chunk(chunk)
    call = record.call("v1", {})
    attributes = call.attributes()
    assert call.completion == "Héllo"
    assert call.prompt_token_ids == [1, 2]
    assert attributes[RESPONSE_TOKEN_IDS] == [7, 8, 9]
    assert attributes[RESPONSE_LOGPROBS] == [-0.5, -0.25, -1.0]
    assert json.loads(attributes[PROMPT_JSON]) == {"messages": [{"role": "user", "content": "hi"}]}
    assert attributes["gen_ai.response.finish_reasons"] == ["stop"]
    assert record.chunks == 3


def test_a_whole_completion_response() -> None:
    record = CallRecord(CallKind.COMPLETION, {"model": "p", "prompt": "abc"})
    record.add_response({
        "model": "p",
        "choices": [{"index": 0, "text": "de", "prompt_token_ids": [3, 4, 5], "token_ids": [6, 7],
                     "logprobs": {"token_logprobs": [-0.1, -0.2]}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    })  # fmt: skip
    attributes = record.call(None, {}).attributes()
    assert attributes["gen_ai.completion"] == "de"
    assert attributes["agl.llm.prompt_token_ids"] == [3, 4, 5]
    assert attributes["gen_ai.usage.input_tokens"] == 3
    assert json.loads(attributes[PROMPT_JSON]) == {"text": "abc"}


def test_an_upstream_without_token_ids_gives_a_call_without_them() -> None:
    """A hosted API that ignores return_token_ids: the call is still recorded, and the
    adapters report it (no token ids) rather than train on guesses."""
    record = CallRecord(CallKind.CHAT, {"model": "gpt", "messages": []})
    record.add_response({"choices": [{"index": 0, "message": {"content": "hi"}}]})
    attributes = record.call(None, {}).attributes()
    assert attributes["gen_ai.completion"] == "hi"
    assert RESPONSE_TOKEN_IDS not in attributes and RESPONSE_LOGPROBS not in attributes
