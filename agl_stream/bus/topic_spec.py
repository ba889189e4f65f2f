"""Topic definitions (topics/*.toml) and the pure comparison of wanted against observed."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from agl_stream.events import EVENT_TYPES

CONFIG_KEYS = ("cleanup.policy", "retention.ms", "compression.type", "segment.ms")


class TopicSpecError(ValueError):
    """A topic definition file is wrong; the message names the file and the setting."""


class TopicSpec(BaseModel):
    """One topic, as data: what `topics apply` creates and what workers check at start."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9._-]+$", description="Name after the prefix.")
    partitions: int = Field(ge=1, le=10_000)
    cleanup_policy: Literal["delete", "compact"]
    retention_ms: int = Field(ge=-1)
    # How soon a segment closes (Kafka's default: 7 days); retention deletes only closed
    # segments, so a short retention needs a short segment too. None: the broker's default.
    segment_ms: int | None = Field(default=None, ge=1000)
    compression: Literal["none", "gzip", "snappy", "lz4", "zstd"]
    key: str
    events: tuple[str, ...]
    co_partitioned_with: str | None = None

    @field_validator("events")
    @classmethod
    def _known_events(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        unknown = sorted(set(value) - set(EVENT_TYPES))
        if unknown:
            raise ValueError(f"unknown event types {unknown}; known: {sorted(EVENT_TYPES)}")
        return value

    def full_name(self, prefix: str) -> str:
        return f"{prefix}{self.name}"

    def configs(self) -> dict[str, str]:
        configs = {
            "cleanup.policy": self.cleanup_policy,
            "retention.ms": str(self.retention_ms),
            "compression.type": self.compression,
        }
        if self.segment_ms is not None:
            configs["segment.ms"] = str(self.segment_ms)
        return configs


def topics_dir() -> Path:
    return Path(str(resources.files("agl_stream.topics")))


OVERRIDES_ENV = "AGL_STREAM_TOPICS_DIR"
# What a deployment may set per topic; the rest (key, events, cleanup policy) is the
# contract the code relies on.
OVERRIDABLE = frozenset({"partitions", "retention_ms", "segment_ms", "compression"})


def overrides_dir() -> Path | None:
    """A deployment's folder of topic overrides (AGL_STREAM_TOPICS_DIR), if set."""
    value = os.environ.get(OVERRIDES_ENV)
    return Path(value).expanduser() if value else None


def load_topic_specs(
    directory: Path | None = None, overrides: Path | None = None
) -> dict[str, TopicSpec]:
    """Every topics/*.toml, by short name, with a deployment's overrides applied (files in
    `overrides`, default AGL_STREAM_TOPICS_DIR: `name` and any of partitions, retention_ms,
    segment_ms, compression); raises TopicSpecError naming the bad file and setting."""
    directory = directory or topics_dir()
    overrides = overrides if overrides is not None else overrides_dir()
    raw: dict[str, tuple[Path, dict[str, object]]] = {}
    for path in sorted(directory.glob("*.toml")):
        data = _read(path)
        name = str(data.get("name"))
        if name in raw:
            raise TopicSpecError(f"{path}: topic {name!r} is defined twice")
        raw[name] = (path, data)
    if overrides is not None:
        if not overrides.is_dir():
            raise TopicSpecError(f"{OVERRIDES_ENV}={overrides} is not a directory")
        for path in sorted(overrides.glob("*.toml")):
            data = _read(path)
            name = str(data.pop("name", path.stem))
            if name not in raw:
                raise TopicSpecError(f"{path}: overrides topic {name!r}, which is not defined")
            refused = sorted(set(data) - OVERRIDABLE)
            if refused:
                raise TopicSpecError(
                    f"{path}: {', '.join(refused)} cannot be set per deployment (only "
                    f"{', '.join(sorted(OVERRIDABLE))})"
                )
            raw[name] = (path, {**raw[name][1], **data})
    specs: dict[str, TopicSpec] = {}
    for name, (path, data) in raw.items():
        try:
            specs[name] = TopicSpec.model_validate(data)
        except ValidationError as exc:
            raise TopicSpecError(f"{path}: {exc}") from exc
    for spec in specs.values():
        partner = spec.co_partitioned_with
        if partner is None:
            continue
        if partner not in specs:
            raise TopicSpecError(
                f"{spec.name}: co_partitioned_with names unknown topic {partner!r}"
            )
        if specs[partner].partitions != spec.partitions or specs[partner].key != spec.key:
            raise TopicSpecError(
                f"{spec.name} must have the same partitions and key as {partner}, "
                "which it is co-partitioned with (set both in the overrides)"
            )
    return specs


def _read(path: Path) -> dict[str, object]:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise TopicSpecError(f"{path}: {exc}") from exc


@dataclass(frozen=True)
class ObservedTopic:
    name: str
    partitions: int
    replication_factor: int
    configs: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Drift:
    topic: str
    setting: str
    expected: str
    actual: str
    fixable: bool  # topics apply can alter it in place

    def describe(self) -> str:
        return f"{self.topic}: {self.setting} is {self.actual}, expected {self.expected}"


@dataclass(frozen=True)
class TopicPlan:
    create: tuple[TopicSpec, ...]
    drift: tuple[Drift, ...]
    in_sync: tuple[str, ...]

    @property
    def unfixable(self) -> tuple[Drift, ...]:
        return tuple(d for d in self.drift if not d.fixable)


def plan_topics(
    specs: Iterable[TopicSpec],
    observed: Mapping[str, ObservedTopic],
    prefix: str,
    replication_factor: int,
) -> TopicPlan:
    """What `topics apply` must do to make the broker match the specs."""
    create: list[TopicSpec] = []
    drift: list[Drift] = []
    in_sync: list[str] = []
    for spec in specs:
        name = spec.full_name(prefix)
        seen = observed.get(name)
        if seen is None:
            create.append(spec)
            continue
        found = _drift(spec, name, seen, replication_factor)
        drift += found
        if not found:
            in_sync.append(name)
    return TopicPlan(tuple(create), tuple(drift), tuple(in_sync))


def _drift(spec: TopicSpec, name: str, seen: ObservedTopic, replication: int) -> list[Drift]:
    out = []
    if seen.partitions != spec.partitions:
        out.append(Drift(name, "partitions", str(spec.partitions), str(seen.partitions), False))
    if seen.replication_factor != replication:
        out.append(
            Drift(name, "replication factor", str(replication), str(seen.replication_factor), False)
        )
    for key, expected in spec.configs().items():
        actual = seen.configs.get(key)
        if actual is not None and actual != expected:
            out.append(Drift(name, key, expected, actual, True))
    return out


# Drift that changes what a worker would compute: where keys live, and whether old values
# of a key survive. Retention and compression drift are reported by `topics apply` only.
BLOCKING = frozenset({"partitions", "cleanup.policy"})


def readiness_problems(
    needed: Iterable[TopicSpec],
    observed: Mapping[str, ObservedTopic],
    prefix: str,
    replication_factor: int,
) -> list[str]:
    """Why a worker must not start on this broker: one sentence per problem, each saying how
    to fix it. Empty when every topic the worker uses exists and is partitioned and cleaned
    up as specified."""
    plan = plan_topics(needed, observed, prefix, replication_factor)
    problems = [
        f"topic {s.full_name(prefix)} does not exist: run `agl-stream topics apply`"
        for s in plan.create
    ]
    for d in plan.drift:
        if d.setting == "partitions":
            problems.append(
                f"{d.describe()}: the partition count decides where each key lives, so it "
                "cannot change in place; recreate the topic (losing its data) or set "
                "partitions in topics/ to match"
            )
        elif d.setting in BLOCKING:
            problems.append(
                f"{d.describe()}: run `agl-stream topics apply`, or recreate the topic where "
                "the broker cannot alter topic configs"
            )
    return problems
