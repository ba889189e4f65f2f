"""`POST /rewards`: rewards from other systems over HTTP, token-protected. The body is one
JSON object or a list of them (at most 1000):

    {"rollout_id": "ro-42", "value": 1.0, "name": "thumbs", "attempt_id": "...",
     "span_id": "b7ad6b7169203331", "source": "webapp", "metadata": {"user": "u-9"},
     "given_at": "2026-11-27T10:00:00Z", "event_id": "a UUID"}

`session` may stand for `rollout_id` on a gateway with sessions (the rollout of that session
key). `event_id` (optional, a UUID) is the reward's identity: a client that sends a reward
again after a lost answer with the same id records it once. Each becomes a RewardRecorded on
the rollouts topic; the answer, once the broker has them all, lists their event ids. A body
with any problem is refused whole (400, naming it); a body over MAX_BODY, or a reward too
large to be one Kafka record, is a 413 naming the limit.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

from aiohttp import web
from aiokafka.errors import MessageSizeTooLargeError

from agl_stream.bus.codec import Codec
from agl_stream.bus.kafka import MAX_RECORD_BYTES
from agl_stream.bus.streams import EventPublisher
from agl_stream.commands.rewards import REWARDS_TOPIC, BadReward, make_reward
from agl_stream.events import RewardRecorded
from agl_stream.gateway.wire import error_body
from agl_stream.runtime.auth import credential_refusal
from agl_stream.runtime.http_errors import read_body

MAX_REWARDS = 1000
# A reward is a few hundred bytes (ids, a name, a little metadata): 1000 of them at 8 KiB each
# is the largest legitimate body.
MAX_BODY = 8 * 1024 * 1024
FIELDS = frozenset(
    {"rollout_id", "session", "value", "name", "attempt_id", "span_id", "source", "metadata",
     "given_at", "event_id"}
)  # fmt: skip


class BadRewards(ValueError):
    """A body of rewards that cannot be recorded; the message names the first problem."""

    status = 400


class RewardTooLarge(BadRewards):
    status = 413


def parse_rewards(
    raw: bytes, session_rollout: Callable[[str], str] | None = None
) -> list[RewardRecorded]:
    try:
        body = json.loads(raw or b"null")
    except ValueError as exc:
        raise BadRewards(f"the body is not JSON: {exc}") from None
    items = body if isinstance(body, list) else [body]
    if not items:
        raise BadRewards("the body is an empty list: send at least one reward")
    if len(items) > MAX_REWARDS:
        raise BadRewards(f"{len(items)} rewards in one request; at most {MAX_REWARDS}")
    rewards = [_reward(f"reward {i}", item, session_rollout) for i, item in enumerate(items)]
    codec = Codec()
    for i, reward in enumerate(rewards):
        # Checked before any is sent, so that the body is refused whole.
        size = len(codec.encode(reward))
        if size > MAX_RECORD_BYTES:
            raise RewardTooLarge(
                f"reward {i} is {size:,} bytes encoded, over the record limit of "
                f"{MAX_RECORD_BYTES:,} (its metadata, most likely)"
            )
    return rewards


def _reward(where: str, item: Any, session_rollout: Callable[[str], str] | None) -> RewardRecorded:
    if not isinstance(item, dict):
        raise BadRewards(f"{where} is not a JSON object")
    unknown = sorted(set(item) - FIELDS)
    if unknown:
        raise BadRewards(f"{where}: unknown fields {unknown}; known: {sorted(FIELDS)}")
    rollout_id = item.get("rollout_id")
    if "session" in item:
        if session_rollout is None or rollout_id is not None:
            raise BadRewards(f"{where}: give rollout_id (this server has no sessions)")
        if not isinstance(item["session"], str) or not item["session"]:
            raise BadRewards(f"{where}: session must be a non-empty string")
        rollout_id = session_rollout(item["session"])
    if not isinstance(rollout_id, str) or not rollout_id:
        raise BadRewards(f"{where}: rollout_id must be a non-empty string")
    value = item.get("value")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRewards(f"{where}: value must be a number")
    given_at = item.get("given_at")
    try:
        when = None if given_at is None else datetime.fromisoformat(str(given_at))
        if when is not None and when.tzinfo is None:
            raise BadRewards(f"{where}: given_at needs a time zone (e.g. 2026-11-27T10:00:00Z)")
        options = {k: item[k] for k in ("name", "attempt_id", "span_id", "event_id") if k in item}
        return make_reward(
            rollout_id, float(value), source=item.get("source", "http"),
            metadata=item.get("metadata"), given_at=when, **options,
        )  # fmt: skip
    except BadReward as exc:
        raise BadRewards(f"{where}: {exc}") from None
    except (ValueError, TypeError) as exc:
        raise BadRewards(f"{where}: {exc}") from None


class RewardEndpoint:
    """The handler; `token` guards it (agl_stream.runtime.auth.credential_refusal)."""

    def __init__(
        self,
        publisher: EventPublisher,
        token: str | None,
        session_rollout: Callable[[str], str] | None = None,
    ) -> None:
        self.publisher = publisher
        self.token = token
        self.session_rollout = session_rollout
        self.recorded = 0

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/rewards", self.handle)

    async def handle(self, request: web.Request) -> web.Response:
        refused = credential_refusal(request, self.token, "the rewards endpoint")
        if refused is not None:
            return refused
        try:
            body = await read_body(request, MAX_BODY, "the rewards endpoint")
            rewards = parse_rewards(body, self.session_rollout)
        except BadRewards as exc:
            return web.Response(
                status=exc.status, body=error_body(str(exc), "invalid_request_error"),
                content_type="application/json",
            )  # fmt: skip
        try:
            sent = [await self.publisher.send(REWARDS_TOPIC, r) for r in rewards]
        except MessageSizeTooLargeError:  # the broker's limit is lower than agl-stream's
            message = (
                "a reward is larger than the broker takes in one record "
                f"({MAX_RECORD_BYTES:,} bytes at most)"
            )
            return web.Response(
                status=413, body=error_body(message, "invalid_request_error"),
                content_type="application/json",
            )  # fmt: skip
        await asyncio.gather(*sent)
        self.recorded += len(rewards)
        return web.json_response(
            {"recorded": len(rewards), "event_ids": [str(r.event_id) for r in rewards]}
        )
