"""Applying topic specs to a broker and checking them before a worker starts."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import IncompatibleBrokerVersion, for_code

from agl_stream.bus.kafka import admin_client, retrying
from agl_stream.bus.topic_spec import (
    CONFIG_KEYS,
    Drift,
    ObservedTopic,
    TopicSpec,
    load_topic_specs,
    plan_topics,
    readiness_problems,
)
from agl_stream.runtime.config import KafkaSettings


class TopicsNotReady(RuntimeError):
    """The broker's topics do not match topics/; the message says how to fix it."""


@dataclass(frozen=True)
class ApplyReport:
    created: tuple[str, ...]
    altered: tuple[Drift, ...]
    unfixed: tuple[Drift, ...]
    in_sync: tuple[str, ...]


async def observe_topics(settings: KafkaSettings, names: Iterable[str]) -> dict[str, ObservedTopic]:
    """Partitions, replication and the configs we manage, for those of `names` that exist."""
    async with admin_client(settings) as admin:
        return await _observe(admin, names)


async def _observe(admin: AIOKafkaAdminClient, names: Iterable[str]) -> dict[str, ObservedTopic]:
    existing = set(await admin.list_topics())
    present = sorted(set(names) & existing)
    if not present:
        return {}
    described = await admin.describe_topics(present)
    responses = await admin.describe_configs(
        [ConfigResource(ConfigResourceType.TOPIC, name) for name in present]
    )
    configs: dict[str, dict[str, str]] = {name: {} for name in present}
    for response in responses:
        for resource in response.resources:
            _code, _message, _type, name, entries = resource[:5]
            for entry in entries:
                key, value = entry[0], entry[1]
                if key in CONFIG_KEYS and value is not None:
                    configs.setdefault(name, {})[key] = value
    observed = {}
    for topic in described:
        partitions = topic["partitions"]
        replication = max((len(p["replicas"]) for p in partitions), default=0)
        name = topic["topic"]
        observed[name] = ObservedTopic(name, len(partitions), replication, configs.get(name, {}))
    return observed


async def apply_topics(
    settings: KafkaSettings, specs: Iterable[TopicSpec] | None = None
) -> ApplyReport:
    """Create missing topics and correct their configs; report what cannot change in place.
    Running it again changes nothing. Returns once every topic is in the brokers' metadata.
    Tried again (with a new admin client) while the brokers answer a retriable error, as a
    broker does for a moment after it was down or frozen (NodeNotReady); brokers that never
    accepted the first client are reported at once (nothing is up to wait for)."""
    wanted = list(specs if specs is not None else load_topic_specs().values())
    answered = False

    async def attempt() -> ApplyReport:
        nonlocal answered
        async with admin_client(settings) as admin:
            answered = True
            return await _apply(admin, settings, wanted)

    return await retrying(attempt, "applying the topics", unless=lambda _: not answered)


async def _apply(
    admin: AIOKafkaAdminClient, settings: KafkaSettings, wanted: list[TopicSpec]
) -> ApplyReport:
    names = [s.full_name(settings.topic_prefix) for s in wanted]
    created: list[str] = []
    for _ in range(_CREATE_ROUNDS):
        observed = await _observe(admin, names)
        plan = plan_topics(wanted, observed, settings.topic_prefix, settings.replication_factor)
        if not plan.create:
            break
        response = await admin.create_topics(
            [
                NewTopic(
                    s.full_name(settings.topic_prefix),
                    s.partitions,
                    settings.replication_factor,
                    topic_configs=s.configs(),
                )
                for s in plan.create
            ]
        )
        created += _created(response)
        # A topic that "already exists" was created a moment ago (by someone else, or by
        # a test) and is not in this broker's metadata yet: look again.
        await _until_visible(admin, names)
    else:
        raise TopicsNotReady(f"topics could not be created on {settings.bootstrap_servers}")
    fixable = [d for d in plan.drift if d.fixable]
    altered = await _alter(admin, fixable)
    await _until_configured(admin, altered)
    left = tuple(d for d in fixable if d not in altered)
    return ApplyReport(
        created=tuple(created),
        altered=altered,
        unfixed=plan.unfixable + left,
        in_sync=tuple(n for n in plan.in_sync if n not in created),
    )


_CREATE_ROUNDS = 5
_TOPIC_ALREADY_EXISTS = 36


def _created(response: Any) -> list[str]:
    """Topics the CreateTopics response says were made; any error but 'already exists' is
    raised with the broker's message."""
    made = []
    for entry in response.topic_errors:
        topic, code, message = entry[0], entry[1], entry[2] if len(entry) > 2 else None
        if code == 0:
            made.append(topic)
        elif code != _TOPIC_ALREADY_EXISTS:
            error = for_code(code)
            raise TopicsNotReady(f"creating topic {topic} failed: {message or error.__name__}")
    return made


async def _until_visible(admin: AIOKafkaAdminClient, names: list[str], within: float = 30) -> None:
    """Wait until every topic's partitions all have a leader in the metadata a broker serves
    (on Apache Kafka it follows a create within milliseconds, not at once)."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        described = await admin.describe_topics(names)
        ready = {
            t["topic"]
            for t in described
            if t["error_code"] == 0
            and t["partitions"]
            and all(p["leader"] >= 0 for p in t["partitions"])
        }
        if ready >= set(names) or asyncio.get_running_loop().time() > deadline:
            return
        await asyncio.sleep(0.05)


async def _until_configured(
    admin: AIOKafkaAdminClient, altered: tuple[Drift, ...], within: float = 30
) -> None:
    """Wait until the brokers describe the altered configs with their new values (a
    broker's view follows an AlterConfigs a moment later)."""
    deadline = asyncio.get_running_loop().time() + within
    while altered and asyncio.get_running_loop().time() < deadline:
        observed = await _observe(admin, {d.topic for d in altered})
        if all(observed[d.topic].configs.get(d.setting) == d.expected for d in altered):
            return
        await asyncio.sleep(0.05)


async def _alter(admin: AIOKafkaAdminClient, drift: list[Drift]) -> tuple[Drift, ...]:
    """Alter topic configs in place; nothing when the broker has no AlterConfigs API (the
    drift is then reported as unfixed rather than failing the whole apply)."""
    if not drift:
        return ()
    by_topic: dict[str, dict[str, str]] = {}
    for d in drift:
        by_topic.setdefault(d.topic, {})[d.setting] = d.expected
    try:
        await admin.alter_configs(
            [
                ConfigResource(ConfigResourceType.TOPIC, topic, configs=values)
                for topic, values in by_topic.items()
            ]
        )
    except IncompatibleBrokerVersion:
        return ()
    return tuple(drift)


async def ensure_topics_ready(settings: KafkaSettings, short_names: Iterable[str]) -> None:
    """Refuse to start a worker whose topics are missing or wrong (raises TopicsNotReady)."""
    specs = load_topic_specs()
    needed = [specs[name] for name in short_names]
    names = [s.full_name(settings.topic_prefix) for s in needed]
    observed = await retrying(lambda: observe_topics(settings, names), "reading the topics")
    problems = readiness_problems(
        needed, observed, settings.topic_prefix, settings.replication_factor
    )
    if problems:
        raise TopicsNotReady(
            f"the topics on {settings.bootstrap_servers} are not ready: " + "; ".join(problems)
        )
