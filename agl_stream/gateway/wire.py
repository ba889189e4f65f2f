"""The OpenAI wire format as the gateway sees it: what to ask an upstream for so that token ids
and logprobs come back, how to read them out of a response or a stream of chunks, and the
shape of an error. Pure functions and small accumulators; no I/O.

Token ids follow vLLM's extension of the API (`return_token_ids`): `prompt_token_ids` on the
response (chat) or on each choice (completions), `token_ids` on each choice or delta.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from agl_stream.agent.llm import LLMCall


class CallKind(StrEnum):
    CHAT = "chat.completions"
    COMPLETION = "completions"


class BadRequest(ValueError):
    """A request body the gateway cannot forward (not JSON, not an object)."""


def parse_request(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw or b"null")
    except ValueError as exc:
        raise BadRequest(f"the request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def prepare_request(kind: CallKind, body: Mapping[str, Any]) -> dict[str, Any]:
    """The body sent upstream: the agent's, plus asks for token ids and logprobs (servers
    that do not know `return_token_ids` ignore it; an agent's own choices are kept)."""
    upstream = dict(body)
    upstream.setdefault("return_token_ids", True)
    if kind is CallKind.CHAT:
        upstream.setdefault("logprobs", True)
    else:
        upstream.setdefault("logprobs", 0)
    return upstream


def error_body(message: str, kind: str = "gateway_error", code: str | None = None) -> bytes:
    """An error in OpenAI's shape, so clients raise their usual exceptions."""
    return json.dumps({"error": {"message": message, "type": kind, "code": code}}).encode()


def _ints(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return list(value)
    return None


def _chat_logprobs(logprobs: Any) -> list[float]:
    if not isinstance(logprobs, Mapping):
        return []
    content = logprobs.get("content") or []
    return [float(item["logprob"]) for item in content if isinstance(item, Mapping)]


def _completion_logprobs(logprobs: Any) -> list[float]:
    if not isinstance(logprobs, Mapping):
        return []
    return [float(v) for v in logprobs.get("token_logprobs") or [] if v is not None]


@dataclass
class CallRecord:
    """What one call asked and got, accumulated from a response or its chunks."""

    kind: CallKind
    request: Mapping[str, Any]
    model: str = ""
    text: list[str] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    response_token_ids: list[int] | None = None
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Mapping[str, Any] | None = None
    choices: int = 0
    chunks: int = 0

    def add_response(self, response: Mapping[str, Any]) -> None:
        """A whole (non-streaming) response."""
        self._read(response, streamed=False)

    def add_chunk(self, chunk: Mapping[str, Any]) -> None:
        """One chunk of a streamed response."""
        self.chunks += 1
        self._read(chunk, streamed=True)

    def _read(self, message: Mapping[str, Any], streamed: bool) -> None:
        self.model = str(message.get("model") or self.model or self.request.get("model") or "")
        if isinstance(message.get("usage"), Mapping):
            self.usage = message["usage"]
        top_prompt = _ints(message.get("prompt_token_ids"))
        if top_prompt is not None:
            self.prompt_token_ids = top_prompt
        for choice in message.get("choices") or []:
            if not isinstance(choice, Mapping):
                continue
            index = int(choice.get("index") or 0)
            self.choices = max(self.choices, index + 1)
            if index != 0:
                continue  # one span per call: the first choice is the one recorded
            self._read_choice(choice, streamed)

    def _read_choice(self, choice: Mapping[str, Any], streamed: bool) -> None:
        prompt = _ints(choice.get("prompt_token_ids"))
        if prompt is not None:
            self.prompt_token_ids = prompt
        if self.kind is CallKind.CHAT:
            part = choice.get("delta") if streamed else choice.get("message")
            content = part.get("content") if isinstance(part, Mapping) else None
            logprobs = _chat_logprobs(choice.get("logprobs"))
        else:
            content = choice.get("text")
            logprobs = _completion_logprobs(choice.get("logprobs"))
        if isinstance(content, str):
            self.text.append(content)
        ids = _ints(choice.get("token_ids"))
        if ids is not None:
            self.response_token_ids = (self.response_token_ids or []) + ids
        self.logprobs.extend(logprobs)
        if choice.get("finish_reason"):
            self.finish_reason = str(choice["finish_reason"])

    def call(self, resources_id: str | None, extra: Mapping[str, Any]) -> LLMCall:
        messages = self.request.get("messages")
        ids = self.response_token_ids
        logprobs = self.logprobs if ids is not None and len(self.logprobs) == len(ids) else None
        attributes: dict[str, Any] = {"gen_ai.operation.name": self.kind.value, **extra}
        if self.finish_reason:
            attributes["gen_ai.response.finish_reasons"] = [self.finish_reason]
        if self.choices > 1:
            attributes["agl.llm.choices"] = self.choices
        if self.usage is not None:
            for source, target in (
                ("prompt_tokens", "gen_ai.usage.input_tokens"),
                ("completion_tokens", "gen_ai.usage.output_tokens"),
            ):
                if isinstance(self.usage.get(source), int):
                    attributes[target] = self.usage[source]
        return LLMCall(
            model=self.model or str(self.request.get("model") or ""),
            completion="".join(self.text),
            messages=[_message(m) for m in messages] if isinstance(messages, list) else None,
            prompt_text=_prompt_text(self.request.get("prompt")),
            prompt_token_ids=self.prompt_token_ids,
            response_token_ids=ids,
            response_logprobs=logprobs,
            resources_id=resources_id,
            extra=attributes,
        )


def _message(message: Any) -> dict[str, str]:
    if not isinstance(message, Mapping):
        return {"content": str(message)}
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in message.items()}


def _prompt_text(prompt: Any) -> str | None:
    if prompt is None or isinstance(prompt, str):
        return prompt
    return json.dumps(prompt)


class SSEDecoder:
    """Server-sent events out of byte chunks: yields each event's data (joined data lines)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[str]:
        self._buffer += data.replace(b"\r\n", b"\n")
        events: list[str] = []
        while b"\n\n" in self._buffer:
            raw, self._buffer = self._buffer.split(b"\n\n", 1)
            lines = [
                line[5:].lstrip(b" ") for line in raw.split(b"\n") if line.startswith(b"data:")
            ]
            if lines:
                events.append(b"\n".join(lines).decode("utf-8", errors="replace"))
        return events


def read_chunk(data: str) -> Mapping[str, Any] | None:
    """A stream event's JSON, None for `[DONE]` or anything that is not a JSON object."""
    if data.strip() == "[DONE]":
        return None
    try:
        chunk = json.loads(data)
    except ValueError:
        return None
    return chunk if isinstance(chunk, Mapping) else None
