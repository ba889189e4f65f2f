"""The dashboard's JSON API over the read model (what the page uses, and all it uses). Every
route is in `openapi.ROUTES`; a bad parameter is a 400 that names it, an unknown rollout a 404."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiokafka.errors import KafkaConnectionError, KafkaError
from pydantic import BaseModel

from agl_stream.bus.codec import Codec, DecodeError
from agl_stream.bus.dead_letters import DeadLetterView
from agl_stream.dashboard.runs import runs_from_versions
from agl_stream.db.outage import reason, unavailable
from agl_stream.events.ids import require_id
from agl_stream.queries import NotFound, QueryError, ReadModel
from agl_stream.queries.dead_letters import read_dead_letters
from agl_stream.queries.params import RolloutFilter
from agl_stream.runtime.config import KafkaSettings

READ_MODEL = web.AppKey("read_model", ReadModel)
KAFKA = web.AppKey("kafka", KafkaSettings)
ACTIONS = web.AppKey("actions", bool)  # cancel and requeue allowed (a token is configured)
ROLLOUT_PARAMETERS = frozenset(RolloutFilter.model_fields)
MAX_DEAD_LETTERS = 1_000
PREVIEW_BYTES = 2_000
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_codec = Codec()


class DeadLetter(BaseModel):
    dlq_offset: int
    source_topic: str
    source_partition: int
    source_offset: int
    reason: str
    kind: str
    consumer: str
    at: str
    size: int | None  # bytes of the record's value; None for a record without one
    event: dict[str, Any] | None  # the value decoded, where it still decodes
    preview: str  # the value's first bytes as text (undecodable bytes escaped)


def _json(value: Any) -> web.Response:
    if isinstance(value, BaseModel):
        return web.json_response(value.model_dump(mode="json"))
    if isinstance(value, list):
        return web.json_response(
            [v.model_dump(mode="json") if isinstance(v, BaseModel) else v for v in value]
        )
    return web.json_response(value)


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def error_shape(status: int, message: str, kind: str) -> web.Response:
    """agl_stream.runtime.http_errors' answers in the API's shape."""
    return error(status, message)


def rollout_id_of(request: web.Request) -> str:
    """The URL's rollout id, by the id rule (a QueryError, 400, naming it)."""
    try:
        return require_id("rollout_id", request.match_info["rollout_id"])
    except ValueError as exc:
        raise QueryError(str(exc)) from None


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Errors of the request's making as JSON with the reason: 400 for a bad parameter, 404
    for something that is not there; 503 while the broker or PostgreSQL is away."""
    try:
        return await handler(request)
    except NotFound as exc:  # before QueryError, of which it is a kind
        return error(404, str(exc))
    except QueryError as exc:
        return error(400, str(exc))
    except KafkaConnectionError as exc:
        return error(503, f"cannot reach the Kafka brokers: {exc}")
    except KafkaError as exc:
        return error(503, f"the broker refused: {exc}")
    except Exception as exc:
        if not unavailable(exc):
            raise
        return error(503, f"PostgreSQL is not answering now, try again: {reason(exc)}")


def _only(request: web.Request, allowed: frozenset[str] | set[str]) -> None:
    unknown = sorted(set(request.query) - set(allowed))
    if unknown:
        raise QueryError(f"unknown parameter {unknown[0]!r}; this route takes {sorted(allowed)}")


def _int(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise QueryError(f"{name} must be a whole number, got {raw!r}") from None


def _bool(name: str, raw: str) -> bool:
    value = {"true": True, "1": True, "false": False, "0": False}.get(raw.lower())
    if value is None:
        raise QueryError(f"{name} must be true or false, got {raw!r}")
    return value


def rollout_filter(request: web.Request) -> RolloutFilter:
    """The query string as a RolloutFilter (repeat status, mode and metadata for several;
    metadata as key=value, or key alone for 'present')."""
    _only(request, ROLLOUT_PARAMETERS)
    q = request.query
    options: dict[str, Any] = {
        k: v for k, v in q.items() if k not in ("status", "mode", "metadata")
    }
    options["status"] = tuple(q.getall("status", []))
    options["mode"] = tuple(q.getall("mode", []))
    metadata: dict[str, str | None] = {}
    for item in q.getall("metadata", []):
        key, sep, value = item.partition("=")
        metadata[key] = value if sep else None
    options["metadata"] = metadata
    if "descending" in options:
        options["descending"] = _bool("descending", options["descending"])
    return RolloutFilter.of(**options)


async def rollouts(request: web.Request) -> web.Response:
    return _json(await request.app[READ_MODEL].rollouts(rollout_filter(request)))


async def rollout(request: web.Request) -> web.Response:
    _only(request, set())
    model = request.app[READ_MODEL]
    rollout_id = rollout_id_of(request)
    found = await model.rollout(rollout_id)
    attempts = await model.attempts(rollout_id)
    rewards = await model.rewards(rollout_id)
    return _json(
        {
            "rollout": found.model_dump(mode="json"),
            "attempts": [a.model_dump(mode="json") for a in attempts],
            "rewards": [r.model_dump(mode="json") for r in rewards],
        }
    )


async def spans(request: web.Request) -> web.Response:
    _only(request, {"attempt_id", "limit"})
    model = request.app[READ_MODEL]
    rollout_id = rollout_id_of(request)
    attempt_id = request.query.get("attempt_id")
    if attempt_id is not None:
        try:
            require_id("attempt_id", attempt_id)
        except ValueError as exc:
            raise QueryError(str(exc)) from None
    limit = _int(request, "limit", 10_000)
    await model.rollout(rollout_id)  # a 404 for an unknown rollout, not an empty list
    found = await model.spans(
        rollout_id, attempt_id=attempt_id, latest_attempt=attempt_id is None, limit=limit
    )
    return _json(found)


async def workers(request: web.Request) -> web.Response:
    _only(request, {"role"})
    return _json(await request.app[READ_MODEL].workers(role=request.query.get("role")))


async def resources(request: web.Request) -> web.Response:
    _only(request, {"name", "limit"})
    model = request.app[READ_MODEL]
    limit = _int(request, "limit", 100)
    return _json(await model.resources_history(name=request.query.get("name"), limit=limit))


async def runs(request: web.Request) -> web.Response:
    _only(request, set())
    return _json(runs_from_versions(await request.app[READ_MODEL].run_versions()))


async def overview(request: web.Request) -> web.Response:
    _only(request, set())
    model = request.app[READ_MODEL]
    counts = await model.status_counts()
    alive = [w for w in await model.workers() if w.health == "alive"]
    roles: dict[str, int] = {}
    for worker in alive:
        roles[worker.role] = roles.get(worker.role, 0) + 1
    return _json(
        {
            "read_model": model.schema,
            "status_counts": counts,
            "workers_alive": roles,
            "actions": request.app[ACTIONS],
        }
    )


async def dead_letters(request: web.Request) -> web.Response:
    _only(request, {"limit"})
    limit = _int(request, "limit", 100)
    if not 1 <= limit <= MAX_DEAD_LETTERS:
        raise QueryError(f"limit must be between 1 and {MAX_DEAD_LETTERS}, got {limit}")
    letters = await read_dead_letters(request.app[KAFKA], limit)
    return _json([dead_letter(x) for x in reversed(letters)])  # newest first


def dead_letter(view: DeadLetterView) -> DeadLetter:
    """A dead letter as the page shows it (pure): its reason, and its value decoded where
    it still decodes, else its first bytes."""
    value = view.value
    event: dict[str, Any] | None = None
    if value is not None:
        try:
            event = {"type": type(decoded := _codec.decode(value)).__name__}
            event |= decoded.model_dump(mode="json")
        except DecodeError:
            event = None
    preview = "" if value is None else value[:PREVIEW_BYTES].decode("utf-8", "backslashreplace")
    return DeadLetter(
        dlq_offset=view.dlq_offset, source_topic=view.source_topic,
        source_partition=view.source_partition, source_offset=view.source_offset,
        reason=view.reason, kind=view.kind, consumer=view.consumer, at=view.at,
        size=None if value is None else len(value), event=event, preview=preview,
    )  # fmt: skip
