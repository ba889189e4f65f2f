"""OpenAPI descriptions, as data, of the HTTP surfaces that have none of their own (the gateway,
its reward route, the OTLP receiver), for the fuzz tests
(tests/integration/runtime/test_http_fuzz.py).
They describe what a legitimate client sends, closely enough that generated requests reach
past the first check; schemathesis also breaks them (negative mode)."""

from __future__ import annotations

from typing import Any

FUZZ_ROLLOUT, FUZZ_ATTEMPT, FUZZ_RESOURCE = "ro-fuzz", "at-fuzz", "main"

_ANSWERS: dict[str, Any] = {"default": {"description": "any answer but a 5xx"}}


def _post(schema: dict[str, Any], parameters: list[dict[str, Any]] | None = None) -> Any:
    return {
        "post": {
            "parameters": parameters or [],
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": _ANSWERS,
        }
    }


def _get() -> Any:
    return {"get": {"responses": _ANSWERS}}


def _path(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True,
            "schema": {"type": "string", "enum": [value]}}  # fmt: skip


_MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
        "content": {"type": "string", "maxLength": 50},
    },
    "required": ["role", "content"],
}
_CHAT = {
    "type": "object",
    "properties": {
        "model": {"type": "string", "maxLength": 20},
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1, "maxItems": 3},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": 64},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "stream": {"type": "boolean"},
        "logprobs": {"type": "boolean"},
    },
    "required": ["model", "messages"],
}
_COMPLETION = {
    "type": "object",
    "properties": {
        "model": {"type": "string", "maxLength": 20},
        "prompt": {"type": "string", "maxLength": 50},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": 64},
        "stream": {"type": "boolean"},
    },
    "required": ["model", "prompt"],
}
_EVENT = {
    "type": "object",
    "properties": {
        "type": {"type": "string", "enum": ["reward", "message", "object", "annotation", "span"]},
        "value": {"type": "number"},
        "message": {"type": "string", "maxLength": 50},
        "name": {"type": "string", "maxLength": 30},
        "attributes": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "required": ["type"],
}
_REWARD = {
    "type": "object",
    "properties": {
        "rollout_id": {"type": "string", "minLength": 1, "maxLength": 40},
        "value": {"type": "number"},
        "name": {"type": "string", "minLength": 1, "maxLength": 30},
        "attempt_id": {"type": "string", "minLength": 1, "maxLength": 40},
        "span_id": {"type": "string", "pattern": "^[0-9a-f]{16}$"},
        "source": {"type": "string", "maxLength": 30},
        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
        "given_at": {"type": "string", "format": "date-time"},
        "event_id": {"type": "string", "format": "uuid"},
    },
    "required": ["rollout_id", "value"],
    "additionalProperties": False,
}
_ATTEMPT = [_path("rollout", FUZZ_ROLLOUT), _path("attempt", FUZZ_ATTEMPT)]

GATEWAY: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {"title": "agl-stream gateway", "version": "1"},
    "paths": {
        "/v1/chat/completions": _post(_CHAT),
        "/v1/completions": _post(_COMPLETION),
        "/v1/models": _get(),
        "/rollouts/{rollout}/attempts/{attempt}/{resource}/v1/chat/completions": _post(
            _CHAT, [*_ATTEMPT, _path("resource", FUZZ_RESOURCE)]
        ),
        "/rollouts/{rollout}/attempts/{attempt}/events": _post(
            {"oneOf": [_EVENT, {"type": "array", "items": _EVENT, "maxItems": 5}]}, _ATTEMPT
        ),
        "/rewards": _post(
            {"oneOf": [_REWARD, {"type": "array", "items": _REWARD, "minItems": 1, "maxItems": 5}]}
        ),
        "/metrics": _get(),
    },
}

_ANY_VALUE = {
    "oneOf": [
        {"type": "object", "properties": {"stringValue": {"type": "string", "maxLength": 40}},
         "required": ["stringValue"]},
        {"type": "object", "properties": {"intValue": {"type": "integer"}},
         "required": ["intValue"]},
        {"type": "object", "properties": {"doubleValue": {"type": "number"}},
         "required": ["doubleValue"]},
        {"type": "object", "properties": {"boolValue": {"type": "boolean"}},
         "required": ["boolValue"]},
    ]
}  # fmt: skip
_KEY_VALUE = {
    "type": "object",
    "properties": {
        "key": {
            "type": "string",
            "enum": [
                "agl.rollout.id",
                "agl.attempt.id",
                "agl.attempt.key",
                "agl.rollout.mode",
                "agl.rollout.input",
                "agl.reward",
                "service.name",
                "gen_ai.prompt",
            ],
        },
        "value": _ANY_VALUE,
    },
    "required": ["key", "value"],
}
_ATTRIBUTES = {"type": "array", "items": _KEY_VALUE, "maxItems": 4}
_NANOS = {"type": "string", "pattern": "^[0-9]{1,19}$"}
_SPAN = {
    "type": "object",
    "properties": {
        "traceId": {"type": "string", "pattern": "^[0-9a-f]{32}$"},
        "spanId": {"type": "string", "pattern": "^[0-9a-f]{16}$"},
        "parentSpanId": {"type": "string", "pattern": "^([0-9a-f]{16})?$"},
        "name": {"type": "string", "maxLength": 40},
        "kind": {"type": "integer", "minimum": 0, "maximum": 5},
        "startTimeUnixNano": _NANOS,
        "endTimeUnixNano": _NANOS,
        "attributes": _ATTRIBUTES,
        "status": {
            "type": "object",
            "properties": {
                "code": {"type": "integer", "minimum": 0, "maximum": 2},
                "message": {"type": "string", "maxLength": 40},
            },
        },
    },
    "required": ["traceId", "spanId", "name"],
}
_EXPORT = {
    "type": "object",
    "properties": {
        "resourceSpans": {
            "type": "array",
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "resource": {"type": "object", "properties": {"attributes": _ATTRIBUTES}},
                    "scopeSpans": {
                        "type": "array",
                        "maxItems": 2,
                        "items": {
                            "type": "object",
                            "properties": {
                                "scope": {
                                    "type": "object",
                                    "properties": {"name": {"type": "string"}},
                                },
                                "spans": {"type": "array", "items": _SPAN, "maxItems": 3},
                            },
                        },
                    },
                },
            },
        }
    },
    "required": ["resourceSpans"],
}

OTLP_RECEIVER: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {"title": "agl-stream ingest otlp", "version": "1"},
    "paths": {"/v1/traces": _post(_EXPORT), "/metrics": _get(), "/health": _get()},
}
