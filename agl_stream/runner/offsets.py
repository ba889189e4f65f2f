"""Which offset a runner may commit on a partition: never past the lowest unfinished record,
so a runner that dies loses nothing and the next owner re-runs exactly what was unfinished."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PartitionProgress:
    """Records of one partition in flight. Pure bookkeeping, no I/O."""

    in_flight: set[int] = field(default_factory=set)
    next_offset: int | None = None  # one past the highest offset handed out

    def started(self, offset: int) -> None:
        self.in_flight.add(offset)
        if self.next_offset is None or offset + 1 > self.next_offset:
            self.next_offset = offset + 1

    def advance(self, next_offset: int) -> None:
        """Everything below next_offset was read (records that needed no work included)."""
        if self.next_offset is None or next_offset > self.next_offset:
            self.next_offset = next_offset

    def finished(self, offset: int) -> None:
        self.in_flight.discard(offset)

    def commit_position(self) -> int | None:
        """The offset to commit: the lowest unfinished one, or one past everything seen."""
        if self.in_flight:
            return min(self.in_flight)
        return self.next_offset

    @property
    def busy(self) -> int:
        return len(self.in_flight)
