"""A fast OpenAI-compatible upstream for the gateway benchmark: answers every chat call at
once with a fixed completion of --tokens tokens, token ids and logprobs included (streamed as
one chunk per token when asked), so what is measured is the gateway, not a model.

    .venv/bin/python -m benchmarks.stub_upstream --port 8000
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from aiohttp import web


def app(tokens: int) -> web.Application:
    ids = list(range(10, 10 + tokens))
    logprobs = {"content": [{"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []}]}

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt_ids = list(range(len(json.dumps(body.get("messages", []))) // 4 + 1))
        if not body.get("stream"):
            choice = {
                "index": 0, "message": {"role": "assistant", "content": "x" * tokens},
                "finish_reason": "length", "token_ids": ids,
                "logprobs": {"content": logprobs["content"] * tokens},
            }  # fmt: skip
            usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": tokens}
            return web.json_response({
                "id": "stub", "object": "chat.completion", "model": "stub",
                "choices": [choice], "prompt_token_ids": prompt_ids, "usage": usage,
            })  # fmt: skip
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, token in enumerate(ids):
            chunk: dict[str, Any] = {
                "id": "stub", "object": "chat.completion.chunk", "model": "stub",
                "choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [token],
                             "logprobs": logprobs,
                             "finish_reason": "length" if i == tokens - 1 else None}],
            }  # fmt: skip
            if i == 0:
                chunk["prompt_token_ids"] = prompt_ids
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    application = web.Application()
    application.router.add_post("/v1/chat/completions", chat)
    return application


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    web.run_app(app(args.tokens), host="127.0.0.1", port=args.port, print=None, access_log=None)
