"""The store facade's live state in memory (pure: no I/O here).

The store is the one writer of its records, so what it decided is what is true: the fold of
its own decisions, on top of the read model as it stood when the store started, answers the
calls without a round trip to PostgreSQL. `Live` holds:

- each rollout it has touched (`RolloutState`: the record, its attempts, the span ids and
  sequence ids of its attempts, the highest span sequence id handed out or seen), loaded from
  the read model the first time a call needs it, then kept by the store's own changes;
- the queue (queuing and requeuing rollouts by when they entered it) and the running
  rollouts, whole: the watchdog and dequeue never ask the database;
- the workers and resources touched, and the id of the latest resources.

Memory does not grow with history: a finished rollout (or a resources version other than the
latest) whose last write the projection holds may be forgotten (`evict`): the read model
then answers for it exactly as the fold would.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from agentlightning.types import AttemptedRollout, Rollout

from agl_stream.compat.agl import records as logic
from agl_stream.compat.agl.records import (
    AnyRecord,
    AttemptRecord,
    ResourcesRecord,
    RolloutRecord,
    WorkerRecord,
)

Position = tuple[str, int]  # (topic, partition)
Offsets = dict[Position, int]
Commit = asyncio.Future[Any]  # a staged write's commit (commit.GroupCommit)
# Rollouts and resources versions kept in memory before finished ones are forgotten.
KEPT = 20_000


@dataclass
class SpanKeys:
    """The span ids and sequence ids one attempt's spans hold."""

    ids: set[str] = field(default_factory=set)
    sequences: set[int] = field(default_factory=set)


@dataclass
class RolloutState:
    record: RolloutRecord
    attempts: dict[str, AttemptRecord] = field(default_factory=dict)
    spans: dict[str, SpanKeys] = field(default_factory=dict)  # per attempt id, when known
    sequence_floor: int | None = None  # the highest sequence id handed out or seen
    written: Offsets = field(default_factory=dict)  # the last committed write of each place
    in_flight: int = 0  # writes staged and not yet committed
    pending: Commit | None = None  # the commit of the last write staged

    @property
    def rollout(self) -> Rollout:
        return self.record.rollout

    def latest(self) -> AttemptRecord | None:
        """The attempt with the highest sequence id."""
        if not self.attempts:
            return None
        return max(self.attempts.values(), key=lambda a: a.attempt.sequence_id)

    def attempted(self) -> Rollout:
        """The rollout as Agent Lightning answers it: with its latest attempt, when any."""
        latest = self.latest()
        if latest is None:
            return self.rollout
        return AttemptedRollout(**self.rollout.model_dump(), attempt=latest.attempt)


@dataclass
class Kept:
    """A worker or resources record and where its last write went."""

    record: WorkerRecord | ResourcesRecord
    written: Offsets = field(default_factory=dict)
    in_flight: int = 0
    pending: Commit | None = None


def committed(state: RolloutState | Kept, offsets: Mapping[Position, int]) -> None:
    """A staged write of the record reached the topics at these offsets."""
    for place, offset in offsets.items():
        state.written[place] = max(state.written.get(place, -1), offset)
    state.in_flight -= 1


def projected_past(written: Mapping[Position, int], projected: Mapping[Position, int]) -> bool:
    """Whether the projection (next offsets to apply) holds every write in `written`."""
    return all(projected.get(place, 0) > offset for place, offset in written.items())


class Live:
    """The fold of the store's decisions (see the module's docstring)."""

    def __init__(self, kept: int = KEPT) -> None:
        self.kept = kept
        self.rollouts: dict[str, RolloutState] = {}
        self.workers: dict[str, Kept] = {}
        self.resources: dict[str, Kept] = {}
        self.latest_resources: str | None = None
        self.running: set[str] = set()
        self._queued: dict[str, float] = {}  # rollout id -> its place (queued_at)
        self._queue: list[tuple[float, float, str]] = []  # (queued_at, created_at, id), lazily
        self.finished_version = 0  # bumped each time a rollout finishes (wait_for_rollouts)

    # ---- rollouts -------------------------------------------------------------------------

    def hold(self, state: RolloutState) -> RolloutState:
        """Keep a rollout loaded from the read model (or made new) and index it."""
        self.rollouts[state.rollout.rollout_id] = state
        self._index(state.record)
        return state

    def put_rollout(self, record: RolloutRecord) -> RolloutState:
        """The rollout's new revision; a rollout not held yet is new (no attempts, spans)."""
        rid = record.rollout.rollout_id
        state = self.rollouts.get(rid)
        if state is None:
            state = RolloutState(record, sequence_floor=0)
            self.rollouts[rid] = state
        else:
            if record.rollout.status in logic.FINISHED and (
                state.rollout.status not in logic.FINISHED
            ):
                self.finished_version += 1
            state.record = record
        self._index(record)
        return state

    def put_attempt(self, record: AttemptRecord) -> RolloutState:
        state = self.rollouts[record.attempt.rollout_id]
        aid = record.attempt.attempt_id
        if aid not in state.attempts:
            state.spans.setdefault(aid, SpanKeys())  # a new attempt has no spans
        state.attempts[aid] = record
        return state

    def _index(self, record: RolloutRecord) -> None:
        rid = record.rollout.rollout_id
        status = record.rollout.status
        if status in logic.RUNNING:
            self.running.add(rid)
        else:
            self.running.discard(rid)
        place = record.queued_at if status in logic.QUEUING else None
        if place is None:
            self._queued.pop(rid, None)
        elif self._queued.get(rid) != place:
            self._queued[rid] = place
            heapq.heappush(self._queue, (place, record.created_at, rid))

    def queued(self, limit: int) -> list[RolloutState]:
        """The first `limit` rollouts of the queue, in order (they stay queued)."""
        out: list[RolloutState] = []
        skipped: list[tuple[float, float, str]] = []
        while self._queue and len(out) < limit:
            entry = heapq.heappop(self._queue)
            place, _, rid = entry
            if self._queued.get(rid) != place:
                continue  # left the queue, or entered it again at another place
            out.append(self.rollouts[rid])
            skipped.append(entry)
        for entry in skipped:
            heapq.heappush(self._queue, entry)
        return out

    def queue_length(self) -> int:
        return len(self._queued)

    # ---- workers and resources ---------------------------------------------------------------

    def put_worker(self, record: WorkerRecord) -> Kept:
        kept = self.workers.setdefault(record.worker.worker_id, Kept(record))
        kept.record = record
        return kept

    def put_resources(self, record: ResourcesRecord, latest: bool) -> Kept:
        kept = self.resources.setdefault(record.update.resources_id, Kept(record))
        kept.record = record
        if latest:
            self.latest_resources = record.update.resources_id
        return kept

    def put(self, record: AnyRecord) -> RolloutState | Kept:
        """A record's new revision in the fold; what holds it (for its write's offsets)."""
        if isinstance(record, RolloutRecord):
            return self.put_rollout(record)
        if isinstance(record, AttemptRecord):
            return self.put_attempt(record)
        if isinstance(record, WorkerRecord):
            return self.put_worker(record)
        return self.put_resources(record, latest=True)

    # ---- forgetting ------------------------------------------------------------------------

    def over(self) -> bool:
        return len(self.rollouts) > self.kept or len(self.resources) > self.kept

    def evict(self, projected: Mapping[Position, int]) -> int:
        """Forget finished rollouts and older resources versions the projection holds, the
        oldest first, until at most `kept` of each remain; how many were forgotten."""
        forgotten = 0
        for rid in list(self._evictable_rollouts(projected, len(self.rollouts) - self.kept)):
            del self.rollouts[rid]
            forgotten += 1
        surplus = len(self.resources) - self.kept
        for res_id, kept_res in list(self.resources.items()):
            if surplus <= 0:
                break
            if res_id == self.latest_resources or kept_res.in_flight:
                continue
            if projected_past(kept_res.written, projected):
                del self.resources[res_id]
                surplus -= 1
                forgotten += 1
        return forgotten

    def _evictable_rollouts(self, projected: Mapping[Position, int], surplus: int) -> Iterator[str]:
        for rid, state in self.rollouts.items():
            if surplus <= 0:
                return
            if state.rollout.status not in logic.FINISHED or state.in_flight:
                continue
            if projected_past(state.written, projected):
                surplus -= 1
                yield rid
