"""Giving a rollout a reward from outside its attempt, from Python: a user's feedback, a CI
result, a human label, at any time after the attempt started.

    async with RewardSender(kafka) as rewards:
        await rewards.send("ro-42", 1.0, name="thumbs", source="webapp")

    record_reward("ro-42", 1.0, name="thumbs")  # blocking, one reward, configured broker

The reward is a RewardRecorded event on the rollouts topic, keyed by rollout id. Whether it
counts is decided by its consumers from that partition's order: after an attempt of its
rollout (and of the attempt it names) it does; before any, or for a rollout that does not
exist, it goes to the dead-letter topic with the reason (agl_stream.events.reward_rules).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.structs import RecordMetadata
from pydantic import ValidationError

from agl_stream.bus.kafka import producer
from agl_stream.bus.streams import EventPublisher, Topics
from agl_stream.events import DEFAULT_REWARD_NAME, RewardRecorded
from agl_stream.events.reward_rules import given_at_problem
from agl_stream.runtime.config import KafkaSettings, load

REWARDS_TOPIC = "rollouts"


class BadReward(ValueError):
    """A reward that cannot be recorded (not finite, an empty name, a malformed span id)."""


def make_reward(
    rollout_id: str,
    value: float,
    *,
    name: str = DEFAULT_REWARD_NAME,
    attempt_id: str | None = None,
    span_id: str | None = None,
    source: str | None = None,
    metadata: Mapping[str, str] | None = None,
    given_at: datetime | None = None,
    event_id: uuid.UUID | str | None = None,
) -> RewardRecorded:
    """The event, checked; BadReward names what is wrong. The same `event_id` again is the
    same reward (recorded once): give one to make a retried send safe."""
    fields: dict[str, Any] = {
        "rollout_id": rollout_id, "value": value, "name": name, "attempt_id": attempt_id,
        "span_id": span_id, "source": source, "metadata": dict(metadata or {}),
    }  # fmt: skip
    if given_at is not None:
        problem = given_at_problem(given_at, datetime.now(UTC))
        if problem is not None:
            raise BadReward(f"not a valid reward: {problem}")
        fields["occurred_at"] = given_at
    if event_id is not None:
        fields["event_id"] = event_id
    try:
        return RewardRecorded.model_validate(fields)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'reward'}: {e['msg']}" for e in exc.errors()
        )
        raise BadReward(f"not a valid reward: {problems}") from None


class RewardSender:
    """Sends rewards through one producer (acks=all); `send` returns where it landed."""

    def __init__(self, kafka: KafkaSettings) -> None:
        self.kafka = kafka
        self._producer: AIOKafkaProducer | None = None
        self._context: Any = None

    async def __aenter__(self) -> RewardSender:
        self._context = producer(self.kafka)
        self._producer = await self._context.__aenter__()
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self._context.__aexit__(kind, error, traceback)
        self._producer = None

    async def send_event(self, event: RewardRecorded) -> RecordMetadata:
        assert self._producer is not None, "use RewardSender as an async context manager"
        return await EventPublisher(self._producer, Topics(self.kafka)).publish(
            REWARDS_TOPIC, event
        )

    async def send(self, rollout_id: str, value: float, **options: Any) -> RecordMetadata:
        """Record one reward (options as for make_reward); raises BadReward before sending."""
        return await self.send_event(make_reward(rollout_id, value, **options))


def record_reward(
    rollout_id: str, value: float, kafka: KafkaSettings | None = None, **options: Any
) -> RewardRecorded:
    """Record one reward and wait until the broker has it (a blocking call, for scripts)."""
    event = make_reward(rollout_id, value, **options)
    settings = kafka or load(KafkaSettings)

    async def send() -> None:
        async with RewardSender(settings) as sender:
            await sender.send_event(event)

    asyncio.run(send())
    return event
