"""The resources a runner hands its agents: the latest version, and any pinned one."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from agl_stream.events import ResourcesPublished


@dataclass
class ResourceCache:
    """A fold over the compacted resources topic (every version is kept by its id)."""

    versions: dict[str, ResourcesPublished] = field(default_factory=dict)
    latest: ResourcesPublished | None = None
    _changed: asyncio.Event | None = None

    def apply(self, event: ResourcesPublished) -> None:
        self.versions[event.resources_id] = event
        if self.latest is None or event.version >= self.latest.version:
            self.latest = event
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def wait_for(self, resources_id: str, within: float) -> ResourcesPublished | None:
        """A pinned version the runner has not seen yet: it may be on its way (published
        just before the task that pins it was enqueued). None if it does not come."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while resources_id not in self.versions:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            if self._changed is None:
                self._changed = asyncio.Event()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return None
        return self.versions[resources_id]

    def resolve(self, pinned: str | None) -> ResourcesPublished | None:
        """The pinned version, or the latest; raises KeyError for an unknown pin."""
        if pinned is None:
            return self.latest
        return self.versions[pinned]
