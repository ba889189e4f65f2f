"""Enqueue is safe to run again: a run cut off half-way is completed, a finished one is
not repeated, and only an explicit new key (--again) queues the same inputs anew."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition

from agl_stream.bus.streams import Topics, read_partitions
from agl_stream.commands.enqueue import (
    CHUNK,
    EnqueueError,
    RolloutOptions,
    enqueue,
    enqueue_batch,
    rollout_ids,
)
from agl_stream.events import RolloutQueued
from agl_stream.runtime.config import KafkaSettings
from tests.support.helpers import invoke_cli

pytestmark = pytest.mark.slow


async def queued(kafka: KafkaSettings) -> Counter[str]:
    topics = Topics(kafka)
    tps = [TopicPartition(topics.name("tasks"), p) for p in range(topics.specs["tasks"].partitions)]
    return Counter(
        e.rollout_id for e in await read_partitions(kafka, tps) if isinstance(e, RolloutQueued)
    )


class Cut(Exception):
    """The process dying between sending a chunk and committing it."""


async def test_a_run_cut_off_mid_chunk_is_completed_without_duplicates(
    kafka: KafkaSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    tasks = [{"n": i} for i in range(2 * CHUNK + 200)]
    real = AIOKafkaProducer.send_offsets_to_transaction
    calls = 0

    async def dies_on_the_second_chunk(self: AIOKafkaProducer, *args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise Cut
        return await real(self, *args)

    with monkeypatch.context() as patch:
        patch.setattr(AIOKafkaProducer, "send_offsets_to_transaction", dies_on_the_second_chunk)
        with pytest.raises(Cut):
            await enqueue(kafka, tasks, RolloutOptions(), key="nightly-42")
    # The second chunk's records were sent, not committed: readers see the first chunk only.
    assert sum((await queued(kafka)).values()) == CHUNK
    again = await enqueue_batch(kafka, tasks, RolloutOptions(), key="nightly-42")
    assert again.queued_now == len(tasks) - CHUNK
    assert again.ids == rollout_ids("nightly-42", len(tasks))
    counts = await queued(kafka)
    assert set(counts) == set(again.ids) and set(counts.values()) == {1}
    third = await enqueue_batch(kafka, tasks, RolloutOptions(), key="nightly-42")
    assert third.queued_now == 0
    assert sum((await queued(kafka)).values()) == len(tasks)
    # The same key for other inputs is refused, not half-applied.
    with pytest.raises(EnqueueError, match="already queued 1,200 rollouts of other task inputs"):
        await enqueue(kafka, tasks[1:], RolloutOptions(), key="nightly-42")
    # No key: each call is new work.
    first = await enqueue(kafka, tasks[:3])
    second = await enqueue(kafka, tasks[:3])
    assert len(set(first) | set(second)) == 6


async def test_the_cli_queues_a_file_once_unless_told_again(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    source = tmp_path / "tasks.jsonl"
    source.write_text("".join(json.dumps({"q": i}) + "\n" for i in range(7)))
    common = ["--bootstrap-servers", kafka.bootstrap_servers, "--topic-prefix", kafka.topic_prefix]
    first = await invoke_cli(*common, "enqueue", str(source))
    assert first.exit_code == 0, first.output
    assert "queued 7 rollouts" in first.output
    second = await invoke_cli(*common, "enqueue", str(source))
    assert second.exit_code == 0, second.output
    assert "all 7 rollouts were queued" in second.output and "--again" in second.output
    assert sum((await queued(kafka)).values()) == 7
    other = await invoke_cli(*common, "enqueue", "--max-attempts", "2", str(source))
    assert "queued 7 rollouts" in other.output  # other options: other rollouts
    fresh = await invoke_cli(*common, "enqueue", "--again", str(source))
    assert "queued 7 rollouts" in fresh.output
    assert sum((await queued(kafka)).values()) == 21
    both = await invoke_cli(*common, "enqueue", "--again", "--key", "k", str(source))
    assert both.exit_code == 2 and "exclude each other" in both.output
