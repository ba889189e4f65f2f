"""The JSON API's routes as data: the server registers exactly these, and the OpenAPI
document is built from them and from the read model's pydantic models, so neither drifts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from agl_stream import __version__
from agl_stream.dashboard import api
from agl_stream.dashboard.runs import Run
from agl_stream.queries.models import Attempt, Page, Resources, Rollout, Span, Worker
from agl_stream.queries.params import MAX_LIMIT, MODES, ROLLOUT_STATUSES, SORTS


class RolloutDetail(BaseModel):
    rollout: Rollout
    attempts: list[Attempt]


class Overview(BaseModel):
    read_model: str
    status_counts: dict[str, int]
    workers_alive: dict[str, int]


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


def _strings(values: tuple[str, ...]) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "string", "enum": list(values)}}


ROLLOUT_ID = Param("rollout_id", {"type": "string"}, "the rollout's id", "path")
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
            Param("cursor", {"type": "string"}),
            Param("id", {"type": "string"}, "search by id (alone)"),
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
            Param("attempt_id", {"type": "string"}),
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
]


def document() -> dict[str, Any]:
    models: list[type[BaseModel]] = [r.response for r in ROUTES] + [ErrorBody]
    refs, schemas = models_json_schema(
        [(m, "serialization") for m in models], ref_template="#/components/schemas/{model}"
    )
    paths: dict[str, Any] = {}
    for route in ROUTES:
        body = refs[(route.response, "serialization")]
        if route.many:
            body = {"type": "array", "items": body}
        error = {"content": {"application/json": {"schema": refs[(ErrorBody, "serialization")]}}}
        paths[route.path] = {
            "get": {
                "summary": route.summary,
                "parameters": [_parameter(p) for p in route.params],
                "responses": {
                    "200": {"description": "OK", "content": {"application/json": {"schema": body}}},
                    "400": {"description": "A bad parameter; the error names it", **error},
                    "404": {"description": "No such rollout", **error},
                },
            }
        }
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
        "components": {"schemas": schemas.get("$defs", {})},
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
