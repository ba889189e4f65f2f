"""Which offset a runner may commit on a partition, and from where the next owner must fold
the rollouts partition. Pure bookkeeping, no I/O.

The commit never passes the lowest unfinished record, so a runner that dies loses nothing
and the next owner re-runs exactly what was unfinished. With the offset goes the rollouts
offset its fold must start from: the earliest rollouts event that any record at or above the
committed offset relies on (its own first event, or the fact its plan was made from). The
fold therefore reads what is still relevant, not the partition's whole history.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PartitionProgress:
    """Records of one tasks partition: in flight, handled, and what they rely on."""

    in_flight: set[int] = field(default_factory=set)
    next_offset: int | None = None  # one past the highest offset handed out
    # task offset -> the rollouts offset the record relies on
    relies_on: dict[int, int] = field(default_factory=dict)
    rollouts_end: int = 0  # one past the last rollouts event known committed
    # What this owner inherited: records below `inherited_until` (the tasks end when it
    # took over) may have been handled by an earlier owner and rely on `inherited_from`.
    inherited_from: int = 0
    inherited_until: int = 0

    def started(self, offset: int, relies_on: int | None = None) -> None:
        self.in_flight.add(offset)
        self.handled(offset, relies_on)

    def handled(self, offset: int, relies_on: int | None) -> None:
        """A record was planned (run, skipped, decided); `relies_on` as in Plan. A record
        that relies on no earlier fact relies on what it will write, which lands after
        everything known written now."""
        self.relies_on[offset] = self.rollouts_end if relies_on is None else relies_on
        if self.next_offset is None or offset + 1 > self.next_offset:
            self.next_offset = offset + 1

    def wrote(self, rollouts_offset: int) -> None:
        """An event landed on the rollouts partition (committed)."""
        self.rollouts_end = max(self.rollouts_end, rollouts_offset + 1)

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

    def checkpoint(self) -> tuple[int, int] | None:
        """(tasks offset to commit, rollouts offset the next owner folds from); forgets
        what records below the commit relied on."""
        position = self.commit_position()
        if position is None:
            return None
        for offset in [o for o in self.relies_on if o < position]:
            del self.relies_on[offset]
        starts = [self.rollouts_end]
        if position < self.inherited_until:
            starts.append(self.inherited_from)
        starts += self.relies_on.values()
        return position, min(starts)

    @property
    def busy(self) -> int:
        return len(self.in_flight)
