"""Group commit: the store's writes, several calls' to one Kafka transaction.

A call stages its events and waits for the transaction that holds them. While one transaction
is in flight, the calls that arrive queue; the next transaction takes them all, in the order
they were staged. So a burst of calls (runners' spans, a batch's claims) costs one commit, not
one each, and a call still returns only once its events are durable and acknowledged.

A failed transaction fails its calls and every call staged after it (they were decided on top
of it); `failure` then holds the reason until the store has rebuilt its state (`recovered`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from aiokafka import AIOKafkaProducer
from aiokafka.errors import ProducerFenced
from aiokafka.structs import RecordMetadata

from agl_stream.bus.streams import EventPublisher, Prepared

log = logging.getLogger(__name__)
# aiokafka waits for a transaction coordinator without end: a commit that takes longer fails
# its calls (the store then starts a new producer, which ends the old transaction).
COMMIT_SECONDS = 30.0


_SLOW = "the broker did not commit the store's transaction within {:g} s"


@dataclass
class Staged:
    """One call's records and the future of their offsets."""

    records: Sequence[Prepared]
    done: asyncio.Future[list[RecordMetadata]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class GroupCommit:
    """Commits staged events in transactions, one at a time, as many calls each as wait."""

    def __init__(
        self,
        producer: AIOKafkaProducer,
        publisher: EventPublisher,
        fenced: Callable[[ProducerFenced], BaseException],
    ) -> None:
        self._producer = producer
        self._publisher = publisher
        self._fenced = fenced
        self._waiting: list[Staged] = []
        self._wake = asyncio.Event()
        self._last: Staged | None = None
        self.failure: BaseException | None = None
        self.transactions = 0  # committed, and the calls they held and the time they took
        self.calls = 0
        self.seconds = 0.0
        self._task = asyncio.create_task(self._run(), name="agl-store-commits")

    def stage(self, records: Sequence[Prepared]) -> asyncio.Future[list[RecordMetadata]]:
        """Queue a call's events for the next transaction; the future resolves at its commit."""
        staged = Staged(records)
        staged.done.add_done_callback(_retrieved)  # a call may wait on a later one instead
        if self.failure is not None:
            staged.done.set_exception(self.failure)
        else:
            self._waiting.append(staged)
            self._wake.set()
        self._last = staged
        return staged.done

    async def settled(self) -> None:
        """Return once everything staged so far is committed (raise if it failed)."""
        last = self._last
        if last is not None:
            await asyncio.shield(last.done)

    def recovered(self) -> None:
        """The store rebuilt its state after a failure: stage again."""
        self.failure = None
        self._last = None

    async def close(self) -> None:
        if self.transactions:
            log.info(
                "the store committed %d call(s) in %d transaction(s), %.1f ms each on average",
                self.calls,
                self.transactions,
                1000 * self.seconds / self.transactions,
            )
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._fail(self._waiting, RuntimeError("the store closed before this call committed"))

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._waiting = self._waiting, []
            if not batch:
                continue
            began = time.perf_counter()
            try:
                async with asyncio.timeout(COMMIT_SECONDS):
                    metas = await self._commit(batch)
            except asyncio.CancelledError:
                self._fail(batch, RuntimeError("the store closed before this call committed"))
                raise
            except ProducerFenced as exc:
                self._failed(batch, self._fenced(exc))
                continue
            except TimeoutError:
                self._failed(batch, TimeoutError(_SLOW.format(COMMIT_SECONDS)))
                log.warning(_SLOW.format(COMMIT_SECONDS))
                continue
            except Exception as exc:  # noqa: BLE001 - each call staged gets the reason
                log.warning("a store transaction of %d call(s) failed: %r", len(batch), exc)
                self._failed(batch, exc)
                continue
            self.transactions += 1
            self.calls += len(batch)
            self.seconds += time.perf_counter() - began
            at = 0
            for staged in batch:
                n = len(staged.records)
                if not staged.done.done():
                    staged.done.set_result(metas[at : at + n])
                at += n

    async def _commit(self, batch: Sequence[Staged]) -> list[RecordMetadata]:
        """One transaction holding the batch's records. On any failure it is left open, not
        aborted: the store rebuilds its state with a new producer, whose start aborts it (an
        abort here would wait on a broker that may be the thing not answering)."""
        sends: list[asyncio.Future[RecordMetadata]] = []
        try:
            await self._producer.begin_transaction()
            for staged in batch:
                for record in staged.records:
                    sends.append(await self._publisher.send_prepared(record))
            # Acknowledged before the commit is asked for, not left to the commit's flush:
            # aiokafka 0.14 fails a batch the broker refused for good without failing the
            # transaction, so committing first could commit one that lacks a call's events.
            metas = [await f for f in sends]
            await self._producer.commit_transaction()
        except BaseException:
            for f in sends:  # the sends of an abandoned transaction fail with it
                f.add_done_callback(lambda done: done.cancelled() or done.exception())
            raise
        return metas

    def _failed(self, batch: list[Staged], exc: BaseException) -> None:
        self.failure = exc
        waiting, self._waiting = self._waiting, []
        self._fail(batch + waiting, exc)

    @staticmethod
    def _fail(staged: Sequence[Staged], exc: BaseException) -> None:
        for s in staged:
            if not s.done.done():
                s.done.set_exception(exc)


def _retrieved(done: asyncio.Future[list[RecordMetadata]]) -> None:
    """Mark a failed commit's error as seen: the calls that staged it raise it themselves."""
    if not done.cancelled():
        done.exception()
