"""Which attempts nobody will end have gone quiet, from the rollouts and spans topics (pure).

Nothing in OTLP says that a trace is over, so an attempt an ingester started (its id begins
with `otlp-`: mapping's rule) is ended by an idle timeout: once no record of it has been
appended for `idle` (broker time against the clock of whoever reads), and its partitions are
read to their end, it is due. Whoever ends it publishes its AttemptFinished (succeeded, its
distinct spans counted, its last reward) and, when no other such attempt of its rollout is
still open, the rollout's RolloutFinished; reading that AttemptFinished back closes it here.

A gateway's session (`gateway-sessions-...` attempts) is ended by its gateway; one whose
gateway was killed mid-session is ended the same way once quiet for longer than a gateway
waits (SESSIONS_LOST): unresponsive, with the reason, since its unsent spans are lost.

The fold says how far its reader may commit (the cut): an open attempt holds each partition at
its lowest record, and an attempt already ended holds its rollouts partition at its
AttemptFinished while any record of it lies above the cut, so a reader restarted from the cut
finds every open attempt whole and knows every ended one it meets as ended.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from agl_stream.events import (
    AttemptFinished,
    AttemptStarted,
    AttemptStatus,
    ErrorInfo,
    Event,
    RolloutFinished,
    RolloutStatus,
    SpanRecorded,
)
from agl_stream.events.reward_rules import span_reward
from agl_stream.otlp.mapping import OWN_ATTEMPT_PREFIX, WORKER

TopicPartition = tuple[str, int]  # (short topic name: rollouts or spans, partition)
AttemptKey = tuple[str, str]  # (rollout id, attempt id)
WATCHED_TOPICS = ("rollouts", "spans")
SESSION_PREFIX = "gateway-sessions-"  # a gateway's session attempts (and its worker id)


@dataclass(frozen=True)
class Watched:
    """Which attempts are ended here (ids and starting workers that begin so), and how."""

    attempt_prefix: str
    worker_prefix: str
    status: AttemptStatus = AttemptStatus.SUCCEEDED
    error: ErrorInfo | None = None


INGESTED = Watched(OWN_ATTEMPT_PREFIX, WORKER)
SESSIONS_LOST = Watched(
    SESSION_PREFIX,
    SESSION_PREFIX,
    AttemptStatus.UNRESPONSIVE,
    ErrorInfo(
        type="SessionLost",
        message="the gateway holding this session stopped before ending it (killed, or cut "
        "off): its calls after the last spans it sent are lost, so it is not trained on",
    ),
)


@dataclass
class _Open:
    started: AttemptStarted | None = None
    sequences: set[int] = field(default_factory=set)
    reward: float | None = None
    reward_ns: int = -1  # the end time of the span that gave `reward`
    last_ms: int = 0  # the broker time of its latest record
    low: dict[TopicPartition, int] = field(default_factory=dict)
    high: dict[TopicPartition, int] = field(default_factory=dict)
    ending: bool = False  # its AttemptFinished is published, not read back yet


@dataclass(frozen=True)
class _Ended:
    high: dict[TopicPartition, int]  # its highest record per partition (but the finish)
    finished_at: TopicPartition
    finished_offset: int


@dataclass(frozen=True)
class Ending:
    """What ends a quiet attempt: its AttemptFinished, and its rollout's RolloutFinished when
    it was the rollout's last open ingested attempt."""

    attempt: AttemptFinished
    rollout: RolloutFinished | None
    idle_seconds: float


class IdleAttempts:
    """Folds records of the rollouts and spans topics; `due()` names the quiet attempts."""

    def __init__(self, idle_seconds: float, watched: Watched = INGESTED) -> None:
        if idle_seconds <= 0:
            raise ValueError(f"the idle timeout must be more than 0 seconds, got {idle_seconds}")
        self.watched = watched
        self.idle_ms = int(idle_seconds * 1000)
        self.open: dict[AttemptKey, _Open] = {}
        self.ended: dict[AttemptKey, _Ended] = {}
        self.counts: Counter[str] = Counter()

    def add(self, tp: TopicPartition, offset: int, event: Event, timestamp_ms: int) -> None:
        attempt_id = getattr(event, "attempt_id", None)
        if not isinstance(event, SpanRecorded | AttemptStarted | AttemptFinished):
            return
        if not isinstance(attempt_id, str):
            return
        if not attempt_id.startswith(self.watched.attempt_prefix):
            return
        key = (event.rollout_id, attempt_id)
        ended = self.ended.get(key)
        if ended is not None:
            if not isinstance(event, AttemptFinished):
                ended.high[tp] = max(ended.high.get(tp, -1), offset)
            return
        if isinstance(event, AttemptFinished):
            opened = self.open.pop(key, None)
            self.ended[key] = _Ended(dict(opened.high) if opened else {}, tp, offset)
            self.counts["ended_seen"] += 1
            return
        if isinstance(event, AttemptStarted) and not event.worker_id.startswith(
            self.watched.worker_prefix
        ):
            return  # such an id some other writer used: not ours to end
        entry = self.open.setdefault(key, _Open())
        entry.low[tp] = min(entry.low.get(tp, offset), offset)
        entry.high[tp] = max(entry.high.get(tp, offset), offset)
        entry.last_ms = max(entry.last_ms, timestamp_ms)
        if isinstance(event, AttemptStarted):
            entry.started = entry.started or event
        else:
            entry.sequences.add(event.sequence)
            reward = span_reward(event.name, event.attributes)
            if reward is not None and event.end_time_unix_nano >= entry.reward_ns:
                entry.reward, entry.reward_ns = reward, event.end_time_unix_nano

    def due(self, now_ms: int, caught_up: Iterable[TopicPartition]) -> list[Ending]:
        """The open attempts quiet for the idle timeout whose partitions are read to their
        end (what ends them is read back first), each marked as ending. Spans of an attempt
        whose AttemptStarted is not there (of one ended and forgotten long ago: the trace
        went on) end nothing: they are counted and dropped."""
        read = set(caught_up)
        endings: list[Ending] = []
        for key, entry in list(self.open.items()):
            if entry.ending or now_ms - entry.last_ms < self.idle_ms:
                continue
            if not all(tp in read for tp in _partitions(entry)):
                continue
            if entry.started is None:
                del self.open[key]
                self.counts["late_spans_dropped"] += len(entry.sequences)
                continue
            entry.ending = True
            endings.append(self._ending(key, entry, now_ms))
        return endings

    def cut(self, positions: Mapping[TopicPartition, int]) -> dict[TopicPartition, int]:
        """Per partition, the offset a restarted reader must read from; ended attempts none
        of whose records lie at or above it are forgotten."""
        cut = dict(positions)
        for entry in self.open.values():
            for tp, low in entry.low.items():
                if tp in cut:
                    cut[tp] = min(cut[tp], low)
        for ended in self.ended.values():
            if any(offset >= cut.get(tp, 0) for tp, offset in ended.high.items()):
                tp = ended.finished_at
                if tp in cut:
                    cut[tp] = min(cut[tp], ended.finished_offset)
        self.ended = {
            key: ended
            for key, ended in self.ended.items()
            if ended.finished_offset >= cut.get(ended.finished_at, 0)
            or any(offset >= cut.get(tp, 0) for tp, offset in ended.high.items())
        }
        return cut

    def forget(self, partitions: Iterable[TopicPartition]) -> None:
        """Partitions given to another reader: what was folded from them goes."""
        gone = set(partitions)
        self.open = {k: e for k, e in self.open.items() if not gone & set(e.low)}
        self.ended = {k: e for k, e in self.ended.items() if not gone & {e.finished_at, *e.high}}

    def _ending(self, key: AttemptKey, entry: _Open, now_ms: int) -> Ending:
        rollout_id, attempt_id = key
        assert entry.started is not None
        watched = self.watched
        finished = AttemptFinished(
            rollout_id=rollout_id, attempt_id=attempt_id,
            attempt_number=entry.started.attempt_number, worker_id=entry.started.worker_id,
            status=watched.status, error=watched.error, span_count=len(entry.sequences),
            reward=entry.reward,
        )  # fmt: skip
        others = [
            k for k, e in self.open.items() if k[0] == rollout_id and k != key and not e.ending
        ]
        rollout = None
        if not others:
            status = (
                RolloutStatus.SUCCEEDED
                if watched.status is AttemptStatus.SUCCEEDED
                else RolloutStatus.FAILED
            )
            rollout = RolloutFinished(
                rollout_id=rollout_id, status=status, attempt_id=attempt_id,
                attempt_count=entry.started.attempt_number, error=watched.error,
            )  # fmt: skip
        return Ending(finished, rollout, (now_ms - entry.last_ms) / 1000)


def _partitions(entry: _Open) -> set[TopicPartition]:
    """The attempt's partitions: rollouts and spans are co-partitioned by rollout id."""
    return {(topic, partition) for _, partition in entry.low for topic in WATCHED_TOPICS}
