"""The policy server's side of the OpenAI API: requests read and checked, prompts rendered,
responses and stream chunks built. Pure; the engine and the HTTP shell live elsewhere.

Responses carry what training needs, in vLLM's names: `prompt_token_ids`, each choice's
`token_ids`, and per-token logprobs; `system_fingerprint` is the resources version that
answered.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agl_stream.gateway.wire import CallKind

DEFAULT_MAX_TOKENS = 16


class InvalidRequest(ValueError):
    """A request this server cannot answer; the message names the field."""


@dataclass(frozen=True)
class Generation:
    """One request, checked: the prompt (messages or text) and how to sample."""

    kind: CallKind
    messages: tuple[Mapping[str, Any], ...] | None
    prompt: str | None
    max_tokens: int
    temperature: float
    seed: int | None
    stream: bool
    skip_special_tokens: bool


def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise InvalidRequest(f"{name} must be a number from {low:g} to {high:g}, got {value!r}")
    return float(value)


def read_generation(kind: CallKind, body: Mapping[str, Any], context_length: int) -> Generation:
    messages = prompt = None
    if kind is CallKind.CHAT:
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise InvalidRequest("messages must be a non-empty list of {role, content} objects")
        for message in raw:
            if not isinstance(message, Mapping) or not isinstance(message.get("content"), str):
                raise InvalidRequest("each message needs a role and a string content")
        messages = tuple(raw)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise InvalidRequest("prompt must be a string (one prompt per request here)")
    if int(_number(body, "n", 1, 1, 1)) != 1:
        raise InvalidRequest("n must be 1")
    if body.get("stop"):
        raise InvalidRequest("stop sequences are not supported by this server; stop at EOS")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = int(
        _number({"max_tokens": limit}, "max_tokens", DEFAULT_MAX_TOKENS, 1, context_length)
    )
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise InvalidRequest(f"seed must be an integer, got {seed!r}")
    return Generation(
        kind=kind,
        messages=messages,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        seed=seed,
        stream=bool(body.get("stream")),
        skip_special_tokens=bool(body.get("skip_special_tokens", True)),
    )


def render_prompt(tokenizer: Any, generation: Generation) -> str:
    """The text the model sees: the tokenizer's chat template for messages (contents joined
    by newlines when it has none), the prompt as given otherwise."""
    if generation.messages is None:
        return generation.prompt or ""
    messages = [dict(m) for m in generation.messages]
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return str(rendered)
    return "\n".join(str(m["content"]) for m in messages)


class Detokenizer:
    """Text deltas for a growing list of token ids: a delta is held back while the text ends
    in an incomplete character, so the deltas joined are the whole text decoded at once."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.text()
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""
        delta, self.emitted = text[len(self.emitted) :], text
        return delta

    def finish(self) -> str:
        text = self.text()
        delta = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text
        return delta

    def text(self) -> str:
        return str(self.tokenizer.decode(self.ids, skip_special_tokens=self.skip))


def token_texts(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each token's text, as `tokenizer.decode([id], skip_special_tokens=False)` gives it,
    from the Rust tokenizer directly where there is one: transformers' decode costs ~90 us a
    call in Python, the server's largest cost under load (decode_batch spawns threads: ~1 ms)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return [str(tokenizer.decode([i], skip_special_tokens=False)) for i in ids]
    texts = [backend.decode([i], skip_special_tokens=False) for i in ids]
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        texts = [tokenizer.clean_up_tokenization(text) for text in texts]
    return [str(text) for text in texts]


@dataclass(frozen=True)
class Answered:
    """What the engine produced for one request."""

    prompt_token_ids: Sequence[int]
    token_ids: Sequence[int]
    logprobs: Sequence[float]
    tokens: Sequence[str]  # each token's text, for logprobs entries
    text: str
    finish_reason: str
    resources_id: str


def new_id(kind: CallKind) -> str:
    return ("chatcmpl-" if kind is CallKind.CHAT else "cmpl-") + uuid.uuid4().hex


def _logprobs(kind: CallKind, tokens: Sequence[str], logprobs: Sequence[float]) -> dict[str, Any]:
    if kind is CallKind.CHAT:
        content = [
            {"token": t, "logprob": p, "bytes": list(t.encode()), "top_logprobs": []}
            for t, p in zip(tokens, logprobs, strict=True)
        ]
        return {"content": content}
    return {"tokens": list(tokens), "token_logprobs": list(logprobs), "top_logprobs": None}


def response_body(call_id: str, model: str, answered: Answered, kind: CallKind) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": answered.finish_reason,
        "logprobs": _logprobs(kind, answered.tokens, answered.logprobs),
        "token_ids": list(answered.token_ids),
    }
    if kind is CallKind.CHAT:
        choice["message"] = {"role": "assistant", "content": answered.text}
    else:
        choice["text"] = answered.text
        choice["prompt_token_ids"] = list(answered.prompt_token_ids)
    body: dict[str, Any] = {
        "id": call_id,
        "object": "chat.completion" if kind is CallKind.CHAT else "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": answered.resources_id,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(answered.prompt_token_ids),
            "completion_tokens": len(answered.token_ids),
            "total_tokens": len(answered.prompt_token_ids) + len(answered.token_ids),
        },
    }
    if kind is CallKind.CHAT:
        body["prompt_token_ids"] = list(answered.prompt_token_ids)
    return body


def chunk_body(
    call_id: str,
    model: str,
    kind: CallKind,
    resources_id: str,
    text: str = "",
    token_ids: Sequence[int] = (),
    tokens: Sequence[str] = (),
    logprobs: Sequence[float] = (),
    finish_reason: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """One stream chunk: the first carries the prompt's token ids (and the chat role)."""
    choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": finish_reason,
        "token_ids": list(token_ids),
        "logprobs": _logprobs(kind, tokens, logprobs) if token_ids else None,
    }
    if kind is CallKind.CHAT:
        delta: dict[str, Any] = {"content": text}
        if prompt_token_ids is not None:
            delta["role"] = "assistant"
        choice["delta"] = delta
    else:
        choice["text"] = text
        if prompt_token_ids is not None:
            choice["prompt_token_ids"] = list(prompt_token_ids)
    body: dict[str, Any] = {
        "id": call_id,
        "object": "chat.completion.chunk" if kind is CallKind.CHAT else "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": resources_id,
        "choices": [choice],
    }
    if kind is CallKind.CHAT and prompt_token_ids is not None:
        body["prompt_token_ids"] = list(prompt_token_ids)
    return body
