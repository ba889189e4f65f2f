"""The JSON API's routes as data: the server registers exactly these, and the OpenAPI
document is built from them and from the read model's pydantic models, so neither drifts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from agl_stream.dashboard import actions, api
from agl_stream.dashboard.runs import Run
from agl_stream.queries.models import Attempt, Page, Resources, Reward, Rollout, Span, Worker
from agl_stream.queries.params import MAX_LIMIT, MODES, ROLLOUT_STATUSES, SORTS
from agl_stream.runtime.version import __version__


class RolloutDetail(BaseModel):
    rollout: Rollout
    attempts: list[Attempt]
    rewards: list[Reward]  # given from outside its attempts (late, external), newest first


class Overview(BaseModel):
    read_model: str
    status_counts: dict[str, int]
    workers_alive: dict[str, int]
    actions: bool  # cancel and requeue allowed (a token is configured)


class AuthProblem(BaseModel):
    message: str
    type: str
    code: int


class AuthErrorBody(BaseModel):
    """What agl_stream/runtime/auth.py answers a call without the token (401)."""

    error: AuthProblem


class ErrorBody(BaseModel):
    error: str


@dataclass(frozen=True)
class Param:
    name: str
    schema: dict[str, Any]
    description: str = ""
    where: str = "query"


@dataclass(frozen=True)
class Route:
    path: str  # aiohttp's form: /api/rollouts/{rollout_id}
    handler: api.Handler
    summary: str
    response: type[BaseModel]
    many: bool = False  # a JSON array of `response`
    params: list[Param] = field(default_factory=list)
    method: str = "get"
    body: type[BaseModel] | None = None  # a JSON request body
    ok: int = 200
    errors: dict[int, str] = field(
        default_factory=lambda: {400: "A bad parameter; the error names it", 404: "Not found"}
    )


def _strings(values: tuple[str, ...]) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "string", "enum": list(values)}}


# An id (agl_stream.events.ids) is 1-256 printable characters, or the route answers 400. The
# description names a common part of that rule (word characters and .:@+-), so that an id
# generated from it (schemathesis) is one.
ID = {"type": "string", "minLength": 1, "maxLength": 256, "pattern": r"^[\w.:@+-]+$"}
ROLLOUT_ID = Param("rollout_id", ID, "the rollout's id", "path")
ROUTES = [
    Route("/api/overview", api.overview, "Rollouts by status and the workers alive", Overview),
    Route(
        "/api/runs",
        api.runs,
        "Training runs (GRPO steps, APO rounds), reward curves",
        Run,
        many=True,
    ),
    Route(
        "/api/rollouts",
        api.rollouts,
        "One page of rollouts (keyset pages: pass next_cursor back)",
        Page[Rollout],
        params=[
            Param("status", _strings(ROLLOUT_STATUSES), "repeat for several"),
            Param("mode", _strings(MODES), "repeat for several"),
            Param("since", {"type": "string", "format": "date-time"}),
            Param("until", {"type": "string", "format": "date-time"}),
            Param("time_field", {"type": "string", "enum": ["queued", "updated", "finished"]}),
            Param("worker_id", {"type": "string"}),
            Param("resources_id", {"type": "string"}),
            Param(
                "metadata",
                {"type": "array", "items": {"type": "string"}},
                "key=value, or key (present)",
            ),
            Param("sort", {"type": "string", "enum": list(SORTS)}),
            Param("descending", {"type": "boolean"}),
            Param("limit", {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT}),
            Param("cursor", {"type": "string"}, "a page's next_cursor, as it came"),
        ],
    ),
    Route(
        "/api/rollouts/{rollout_id}",
        api.rollout,
        "A rollout and its attempts",
        RolloutDetail,
        params=[ROLLOUT_ID],
    ),
    Route(
        "/api/rollouts/{rollout_id}/spans",
        api.spans,
        "An attempt's spans (the latest)",
        Span,
        many=True,
        params=[
            ROLLOUT_ID,
            Param("attempt_id", ID),
            Param("limit", {"type": "integer", "minimum": 1, "maximum": 100_000}),
        ],
    ),
    Route(
        "/api/workers",
        api.workers,
        "Workers and their health",
        Worker,
        many=True,
        params=[Param("role", {"type": "string"})],
    ),
    Route(
        "/api/resources",
        api.resources,
        "Resources versions, newest first",
        Resources,
        many=True,
        params=[
            Param("name", {"type": "string"}, "versions holding this resource"),
            Param("limit", {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT}),
        ],
    ),
    Route(
        "/api/dead-letters",
        api.dead_letters,
        "The newest dead letters, with their reasons",
        api.DeadLetter,
        many=True,
        params=[Param("limit", {"type": "integer", "minimum": 1, "maximum": api.MAX_DEAD_LETTERS})],
        errors={400: "A bad parameter", 503: "The broker cannot be reached"},
    ),
    Route(
        "/api/rollouts/{rollout_id}/cancel",
        actions.cancel_rollout,
        "Cancel an open rollout (needs the token)",
        actions.ActionDone,
        params=[ROLLOUT_ID],
        method="post",
        body=actions.CancelRequest,
        ok=202,
        errors={
            400: "A bad body",
            403: "The dashboard is read-only, or a cookie came without X-AGL-Dashboard",
            404: "No such rollout",
            409: "The rollout is finished already",
        },
    ),
    Route(
        "/api/rollouts/{rollout_id}/requeue",
        actions.requeue_rollout,
        "Run a finished rollout again as a new rollout (needs the token)",
        actions.ActionDone,
        params=[ROLLOUT_ID],
        method="post",
        ok=202,
        errors={
            400: "A bad body",
            403: "The dashboard is read-only, or a cookie came without X-AGL-Dashboard",
            404: "No such rollout",
            409: "The rollout has not finished",
        },
    ),
]


def document() -> dict[str, Any]:
    out: Literal["serialization"] = "serialization"
    into: Literal["validation"] = "validation"
    models: list[tuple[type[BaseModel], JsonSchemaMode]] = [(r.response, out) for r in ROUTES]
    models += [(ErrorBody, out), (AuthErrorBody, out)]
    models += [(r.body, into) for r in ROUTES if r.body is not None]
    refs, schemas = models_json_schema(models, ref_template="#/components/schemas/{model}")
    paths: dict[str, Any] = {}
    error = {"content": {"application/json": {"schema": refs[(ErrorBody, "serialization")]}}}
    unauthenticated = {
        "description": "The dashboard has a token and the call did not carry it",
        "content": {"application/json": {"schema": refs[(AuthErrorBody, "serialization")]}},
    }
    for route in ROUTES:
        answer = refs[(route.response, "serialization")]
        if route.many:
            answer = {"type": "array", "items": answer}
        responses = {
            str(route.ok): {
                "description": "OK",
                "content": {"application/json": {"schema": answer}},
            }
        }
        responses |= {
            str(code): {"description": text, **error} for code, text in route.errors.items()
        }
        responses["401"] = unauthenticated
        operation: dict[str, Any] = {
            "summary": route.summary,
            "parameters": [_parameter(p) for p in route.params],
            "responses": responses,
        }
        if route.body is not None:
            schema = refs[(route.body, "validation")]
            operation["requestBody"] = {
                "required": False,  # an empty body reads as {}
                "content": {"application/json": {"schema": schema}},
            }
        paths.setdefault(route.path, {})[route.method] = operation
    paths["/api/live"] = {
        "get": {
            "summary": "Server-sent events: `changed` each time the read model changes",
            "parameters": [],
            "responses": {
                "200": {"description": "An event stream", "content": {"text/event-stream": {}}}
            },
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "agl-stream dashboard API", "version": __version__},
        "paths": paths,
        "components": {
            "schemas": schemas.get("$defs", {}),
            "securitySchemes": {"token": {"type": "http", "scheme": "bearer"}},
        },
        # Only where the dashboard was started with a token; the page logs in once.
        "security": [{}, {"token": []}],
    }


def _parameter(param: Param) -> dict[str, Any]:
    out: dict[str, Any] = {"name": param.name, "in": param.where, "schema": param.schema}
    if param.where == "path":
        out["required"] = True
    if param.description:
        out["description"] = param.description
    if param.schema.get("type") == "array":
        out["style"], out["explode"] = "form", True
    return out
