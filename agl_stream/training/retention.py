"""Which checkpoints a trainer may delete under `--keep N` (pure code; the store deletes).

A checkpoint is **live**, and never pruned, when it is one of the last N steps, or when a
live resources version's checkpoint resource names it. A version is live when it is

- the latest version (the highest-numbered one that is not pin-only), whoever published
  it: runners and the policy server hand it to every rollout that pins nothing; or
- named by a rollout that is queued or running: its RolloutQueued pins it
  (`resources_id`), or one of its attempts started on it (AttemptStarted's `resources_id`),
  and no RolloutFinished of the rollout has been read.

"Read" means by the trainer, from the tasks and rollouts topics it consumes. The fold of
rollouts in flight is saved with each checkpoint along with the offsets it has read to, so
a restarted trainer folds only what it had not (nothing is counted twice, nothing lost). A
rollout queued after a prune, pinned to a version already pruned, finds no checkpoint and
fails with the reason: pin versions the trainer still holds. A version that the policy
server was started pinned to (`serve --pin`) is not seen by the trainer; the server holds
its weights in memory once loaded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from agl_stream.events import AttemptStarted, Event, RolloutFinished, RolloutQueued

TopicPartition = tuple[str, int]
FINISHED_REMEMBERED = 100_000  # a late RolloutQueued of these is not a new rollout in flight


class InFlight:
    """Resources versions named by rollouts that are queued or running."""

    def __init__(
        self,
        rollouts: Mapping[str, Iterable[str]] | None = None,
        read_to: Mapping[TopicPartition, int] | None = None,
    ) -> None:
        self.rollouts: dict[str, set[str]] = {r: set(v) for r, v in (rollouts or {}).items()}
        self.read_to: dict[TopicPartition, int] = dict(read_to or {})
        self._finished: OrderedDict[str, None] = OrderedDict()

    def add(self, tp: TopicPartition, offset: int, event: Event) -> None:
        if offset < self.read_to.get(tp, 0):
            return  # folded before the checkpoint this trainer resumed from
        self.read_to[tp] = offset + 1
        if isinstance(event, RolloutFinished):
            self.rollouts.pop(event.rollout_id, None)
            self._finished[event.rollout_id] = None
            while len(self._finished) > FINISHED_REMEMBERED:
                self._finished.popitem(last=False)
        elif (
            isinstance(event, RolloutQueued | AttemptStarted)
            and event.resources_id
            # Topics interleave: a retry's RolloutQueued may be read after the RolloutFinished.
            and event.rollout_id not in self._finished
        ):
            self.rollouts.setdefault(event.rollout_id, set()).add(event.resources_id)

    def versions(self) -> set[str]:
        return {v for named in self.rollouts.values() for v in named}

    def memory(self) -> dict[str, Any]:
        """What a resumed trainer must remember (JSON-ready)."""
        return {
            "rollouts": {r: sorted(v) for r, v in sorted(self.rollouts.items())},
            "read_to": {f"{t}:{p}": o for (t, p), o in sorted(self.read_to.items())},
        }

    @classmethod
    def resume(cls, memory: Mapping[str, Any]) -> InFlight:
        read_to = {}
        for name, offset in memory.get("read_to", {}).items():
            topic, _, partition = name.rpartition(":")
            read_to[(topic, int(partition))] = int(offset)
        return cls(memory.get("rollouts", {}), read_to)


def prunable(steps: Iterable[int], keep: int, live: Iterable[int]) -> list[int]:
    """The steps to delete: all but the last `keep` and those live versions name."""
    if keep < 1:
        raise ValueError(f"--keep must be at least 1, got {keep}")
    ordered = sorted(set(steps))
    kept = set(ordered[-keep:]) | set(live)
    return [step for step in ordered if step not in kept]
