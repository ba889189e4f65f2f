"""LLM calls recorded as spans: the shape every producer of LLM-call spans writes (the
in-process policy sampler, the gateway on the wire) and the training adapters read.

One span named `agl.llm.call` per call, with OpenTelemetry's gen_ai attribute names where
they exist. Token ids and per-token logprobs are lists of numbers; the prompt (chat
messages or plain text) and the completion text are kept as they were sent and returned.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from agl_stream.agent.tracing import tracer

LLM_CALL_SPAN = "agl.llm.call"

MODEL = "gen_ai.request.model"
PROMPT_JSON = "gen_ai.prompt.json"  # {"messages": [...]} or {"text": "..."}
COMPLETION = "gen_ai.completion"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
PROMPT_TOKEN_IDS = "agl.llm.prompt_token_ids"
RESPONSE_TOKEN_IDS = "agl.llm.response_token_ids"
RESPONSE_LOGPROBS = "agl.llm.response_logprobs"
RESOURCES_ID = "agl.llm.resources_id"
# The policy that answered the call: the name of its resource (a Checkpoint) in the version
# the attempt ran on. A call without it belongs to DEFAULT_POLICY.
POLICY = "agl.llm.policy"
DEFAULT_POLICY = "policy"


@dataclass(frozen=True)
class LLMCall:
    """One request to a model and what came back."""

    model: str
    completion: str
    messages: Sequence[Mapping[str, str]] | None = None
    prompt_text: str | None = None
    prompt_token_ids: Sequence[int] | None = None
    response_token_ids: Sequence[int] | None = None
    response_logprobs: Sequence[float] | None = None
    resources_id: str | None = None
    policy: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def attributes(self) -> dict[str, Any]:
        prompt: dict[str, Any] = (
            {"messages": list(self.messages)}
            if self.messages is not None
            else {"text": self.prompt_text or ""}
        )
        attributes: dict[str, Any] = {
            MODEL: self.model,
            PROMPT_JSON: json.dumps(prompt, sort_keys=True),
            COMPLETION: self.completion,
            **self.extra,
        }
        if self.prompt_token_ids is not None:
            attributes[PROMPT_TOKEN_IDS] = [int(t) for t in self.prompt_token_ids]
            attributes[INPUT_TOKENS] = len(self.prompt_token_ids)
        if self.response_token_ids is not None:
            attributes[RESPONSE_TOKEN_IDS] = [int(t) for t in self.response_token_ids]
            attributes[OUTPUT_TOKENS] = len(self.response_token_ids)
        if self.response_logprobs is not None:
            attributes[RESPONSE_LOGPROBS] = [float(p) for p in self.response_logprobs]
        if self.resources_id is not None:
            attributes[RESOURCES_ID] = self.resources_id
        if self.policy is not None:
            attributes[POLICY] = self.policy
        return attributes


def record_llm_call(
    call: LLMCall,
    started_ns: int | None = None,
    error: BaseException | str | None = None,
    parent: Context | None = None,
) -> str:
    """Record one LLM call as a span of the current attempt; `started_ns` (time.time_ns()
    when the request was sent) makes the span's duration the call's latency; `parent` places
    it in a trace other than the current one (the gateway: the attempt's). Returns the span's
    id (16 hex digits), by which a late reward can name the call."""
    with tracer().start_as_current_span(
        LLM_CALL_SPAN,
        context=parent,
        kind=SpanKind.CLIENT,
        attributes=call.attributes(),
        start_time=started_ns,
    ) as span:
        if isinstance(error, BaseException):
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        elif error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        return format(span.get_span_context().span_id, "016x")
