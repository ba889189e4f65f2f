"""The store's group commit (agl_stream.compat.agl.commit) on a fake producer: what a
transaction holds, and that one whose records the broker refused is not committed
(no broker)."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka.errors import CorruptRecordException, ProducerFenced
from aiokafka.structs import RecordMetadata, TopicPartition

from agl_stream.bus.streams import Prepared
from agl_stream.compat.agl.commit import GroupCommit


class FakeProducer:
    """Records each transaction's begin and commit; a send to a topic in `refused` fails like
    a batch the broker refused for good (aiokafka 0.14 leaves the transaction committable)."""

    def __init__(self, refused: frozenset[str] = frozenset()) -> None:
        self.refused = refused
        self.ends: list[str] = []
        self.offset = 0

    async def begin_transaction(self) -> None:
        self.ends.append("begin")

    async def commit_transaction(self) -> None:
        await asyncio.sleep(0)  # the EndTxn round trip
        self.ends.append("commit")

    async def send(self, record: Prepared) -> asyncio.Future[RecordMetadata]:
        acked: asyncio.Future[RecordMetadata] = asyncio.get_running_loop().create_future()

        def answer() -> None:
            if record.topic in self.refused:
                acked.set_exception(CorruptRecordException())
            else:
                self.offset += 1
                tp = TopicPartition(record.topic, 0)
                acked.set_result(RecordMetadata(record.topic, 0, tp, self.offset, -1, -1, -1))

        asyncio.get_running_loop().call_soon(answer)
        return acked


class FakePublisher:
    def __init__(self, producer: FakeProducer) -> None:
        self.producer = producer

    async def send_prepared(self, record: Prepared) -> asyncio.Future[RecordMetadata]:
        return await self.producer.send(record)


def _record(topic: str) -> Prepared:
    return Prepared(topic, b"v", b"k", ())


def _fenced(exc: ProducerFenced) -> BaseException:
    return RuntimeError("fenced")


def _commits(producer: FakeProducer) -> GroupCommit:
    return GroupCommit(producer, FakePublisher(producer), _fenced)  # type: ignore[arg-type]


async def test_calls_waiting_together_share_a_transaction_and_get_their_offsets() -> None:
    producer = FakeProducer()
    commits = _commits(producer)
    try:
        first = commits.stage([_record("rollouts"), _record("spans")])
        second = commits.stage([_record("rollouts")])
        metas = await asyncio.gather(first, second)
        assert [[m.offset for m in call] for call in metas] == [[1, 2], [3]]
        assert producer.ends == ["begin", "commit"]
    finally:
        await commits.close()


async def test_a_transaction_with_a_refused_record_is_not_committed_and_fails_its_calls() -> None:
    producer = FakeProducer(refused=frozenset({"spans"}))
    commits = _commits(producer)
    try:
        kept = commits.stage([_record("rollouts")])
        refused = commits.stage([_record("rollouts"), _record("spans")])
        for call in (kept, refused):
            with pytest.raises(CorruptRecordException):
                await call
        # The other records of the transaction must not be committed without the refused one
        # (it is left open: the store's rebuild starts a new producer, which aborts it).
        assert producer.ends == ["begin"]
        assert isinstance(commits.failure, CorruptRecordException)
        with pytest.raises(CorruptRecordException):
            await commits.stage([_record("rollouts")])  # until the store rebuilt its state
        commits.recovered()
        assert len(await commits.stage([_record("rollouts")])) == 1
        assert producer.ends == ["begin", "begin", "commit"]
    finally:
        await commits.close()
