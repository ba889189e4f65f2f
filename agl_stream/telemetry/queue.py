"""A bounded queue in front of an OTLP exporter, drained by a thread of its own.

Putting never blocks and never fails: the worker's loop hands over a finished span or a
metrics snapshot and goes on. What cannot be exported is dropped and counted by reason,
with a warning per reason at most every DROP_LOG_SECONDS:
- `queue_full`: the collector is slower than the worker, or unreachable; the oldest item
  goes, the newest stays (in a queue of snapshots that `supersede` one another, replacing
  an older one loses nothing and is no drop);
- `export_failed`: the exporter gave up on a batch (its own log says why);
- `shutdown`: still queued when the worker stopped and the last export's time was up (none
  is given when the latest export failed, or one has waited STUCK_SECONDS for an answer).
A collector that never answers costs the worker nothing but the items it drops.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
DROP_LOG_SECONDS = 60.0
STUCK_SECONDS = 1.0  # a collector that takes longer than this is not waited for at the end
REASONS = {
    "queue_full": "the queue of {limit} was full: the collector at {url} is slower than this "
    "worker, or unreachable",
    "export_failed": "the exporter gave up sending them to {url} (its log says why)",
    "shutdown": "still queued when the worker stopped",
}


class ExportQueue(Generic[T]):
    """Items exported in batches of up to `batch` by `export` (True: taken), at least every
    `delay` seconds while any wait, by a daemon thread."""

    def __init__(
        self,
        signal: str,
        url: str,
        export: Callable[[Sequence[T]], bool],
        limit: int,
        batch: int,
        delay: float,
        supersede: bool = False,
    ) -> None:
        self.signal = signal
        self.url = url
        self.limit = limit
        self.exported = 0
        self.dropped: Counter[str] = Counter()
        self._export = export
        self._batch = batch
        self._delay = delay
        self._supersede = supersede
        self._items: deque[T] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closing = False
        self._failing = False  # the latest export failed
        self._sending_since: float | None = None  # an export waits for its answer
        self._logged_at: dict[str, float] = {}
        self._thread = threading.Thread(target=self._drain, name=f"otlp-{signal}", daemon=True)
        self._thread.start()

    def put(self, item: T) -> None:
        """Queue an item (never blocks); past the limit the oldest is dropped."""
        with self._lock:
            if self._closing:
                return
            full = len(self._items) >= self.limit
            if full:
                self._items.popleft()
            self._items.append(item)
            if len(self._items) >= self._batch:
                self._wake.notify()
        if full and not self._supersede:
            self._drop("queue_full", 1)

    def close(self, within: float) -> None:
        """Export what is queued, waiting at most `within` seconds (not at all when the
        collector is failing); the rest is dropped."""
        with self._lock:
            self._closing = True
            self._wake.notify()
        deadline = time.monotonic() + within
        while self._thread.is_alive() and not self._given_up():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._thread.join(min(left, 0.05))
        with self._lock:
            left, self._items = len(self._items), deque()
        if left:
            self._drop("shutdown", left)

    def _given_up(self) -> bool:
        """The collector failed the latest export, or keeps one waiting too long."""
        with self._lock:
            since = self._sending_since
            stuck = since is not None and time.monotonic() - since > STUCK_SECONDS
            return self._failing or stuck

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._closing and len(self._items) < self._batch:
                    self._wake.wait(self._delay)
                batch = [self._items.popleft() for _ in range(min(self._batch, len(self._items)))]
                closing = self._closing
            if batch:
                self._send(batch)
            elif closing:
                return

    def _send(self, batch: list[T]) -> None:
        with self._lock:
            self._sending_since = time.monotonic()
        try:
            taken = self._export(batch)
        except Exception:  # an exporter bug must not end the thread
            log.exception("OTLP %s export to %s raised", self.signal, self.url)
            taken = False
        with self._lock:
            self._sending_since = None
            self._failing = not taken
            if taken:
                self.exported += len(batch)
        if not taken:
            self._drop("export_failed", len(batch))

    def _drop(self, reason: str, count: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.dropped[reason] += count
            total = self.dropped[reason]
            due = now - self._logged_at.get(reason, -DROP_LOG_SECONDS) >= DROP_LOG_SECONDS
            if due:
                self._logged_at[reason] = now
        if due:
            why = REASONS[reason].format(limit=self.limit, url=self.url)
            log.warning(
                "OTLP %s export: %d dropped so far (%s): %s", self.signal, total, reason, why
            )
