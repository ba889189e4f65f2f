"""The resources a runner hands its agents: the latest version, and any pinned one."""

from __future__ import annotations

from dataclasses import dataclass, field

from agl_stream.events import ResourcesPublished


@dataclass
class ResourceCache:
    """A fold over the compacted resources topic (every version is kept by its id)."""

    versions: dict[str, ResourcesPublished] = field(default_factory=dict)
    latest: ResourcesPublished | None = None

    def apply(self, event: ResourcesPublished) -> None:
        self.versions[event.resources_id] = event
        if self.latest is None or event.version >= self.latest.version:
            self.latest = event

    def resolve(self, pinned: str | None) -> ResourcesPublished | None:
        """The pinned version, or the latest; raises KeyError for an unknown pin."""
        if pinned is None:
            return self.latest
        return self.versions[pinned]
