"""The worker roles as data (workers/*.toml): each role's consumer group, the topics it
consumes as a group member, follows outside the group and produces, how far it scales, and
the bounds of its options. `agl-stream worker` takes its groups and option bounds from here;
tests hold the compose file and the Helm chart to the same specs. Pure, but for reading the
files."""

from __future__ import annotations

import re
import tomllib
from functools import cache
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from agl_stream.bus.topic_spec import load_topic_specs


class RoleSpecError(ValueError):
    """A role definition file is wrong; the message names the file and the setting."""


class Scaling(BaseModel):
    """How many replicas of a role work: `max` a number, or "partitions of TOPIC" (more
    group members than the topic's partitions get none)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min: int = Field(ge=0)
    max: int | str

    @field_validator("max")
    @classmethod
    def _bound(cls, value: int | str) -> int | str:
        if isinstance(value, str) and not re.fullmatch(r"partitions of [a-z]+", value):
            raise ValueError('max is a number or "partitions of TOPIC"')
        return value

    def most(self, partitions: dict[str, int]) -> int:
        """The most replicas that can work, given each topic's partition count."""
        if isinstance(self.max, int):
            return self.max
        return partitions[self.max.removeprefix("partitions of ")]


def group_for(topic_prefix: str, name: str) -> str:
    """A consumer group's name under a topic prefix (agl. and runners -> agl-runners), so
    that deployments sharing a cluster never share a group."""
    return f"{topic_prefix.rstrip('.') or 'agl'}-{name}"


class RoleSpec(BaseModel):
    """One worker role."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: str = Field(pattern=r"^[a-z]+$")
    summary: str
    group: str = Field(pattern=r"^[a-z-]+$", description="The consumer group after the prefix.")
    consumes: tuple[str, ...]
    follows: tuple[str, ...]
    produces: tuple[str, ...]
    scaling: Scaling
    limits: dict[str, tuple[int, int]] = Field(default_factory=dict)

    def group_id(self, topic_prefix: str) -> str:
        """The consumer group of this role under a topic prefix (agl. -> agl-runners)."""
        return group_for(topic_prefix, self.group)

    def limit(self, option: str) -> tuple[int, int]:
        """The [least, most] an option of this role takes."""
        return self.limits[option]


def workers_dir() -> Path:
    """workers/ of the checkout, or the copy installed with the package."""
    return Path(str(resources.files("agl_stream.workers")))


@cache
def load_roles(directory: Path | None = None) -> dict[str, RoleSpec]:
    """Every workers/*.toml by role; RoleSpecError names the bad file and setting, and a
    topic no topics/*.toml defines."""
    directory = directory or workers_dir()
    topics = set(load_topic_specs())
    roles: dict[str, RoleSpec] = {}
    for path in sorted(directory.glob("*.toml")):
        try:
            spec = RoleSpec.model_validate(tomllib.loads(path.read_text()))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise RoleSpecError(f"{path}: {exc}") from None
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise RoleSpecError(f"{path}: {where}: {first['msg']}") from None
        named = {*spec.consumes, *spec.follows, *spec.produces}
        if isinstance(spec.scaling.max, str):
            named.add(spec.scaling.max.removeprefix("partitions of "))
        unknown = sorted(named - topics)
        if unknown:
            raise RoleSpecError(f"{path}: no topic is defined as {', '.join(unknown)}")
        if spec.role in roles:
            raise RoleSpecError(f"{path}: role {spec.role!r} is defined twice")
        roles[spec.role] = spec
    return roles


def role(name: str) -> RoleSpec:
    """One role's spec (runner, projector or trainer)."""
    return load_roles()[name]
