"""Putting rollouts on the tasks topic: from Python, and from JSONL, JSON or Parquet files."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.structs import OffsetAndMetadata
from pydantic import ValidationError

from agl_stream.bus.kafka import (
    acknowledged,
    admin_client,
    producer,
    reachable,
    retrying,
    started,
    stopping,
)
from agl_stream.bus.streams import EventPublisher, Topics
from agl_stream.events import AttemptStatus, RolloutMode, RolloutQueued
from agl_stream.runtime.config import KafkaSettings

MAX_INPUT_BYTES = 900_000  # under the broker's default 1 MB message limit, with the envelope


class EnqueueError(ValueError):
    """A task that cannot be queued; the message says which one and why."""


@dataclass(frozen=True)
class RolloutOptions:
    """How each queued rollout runs (the same for a whole enqueue call)."""

    mode: RolloutMode = RolloutMode.TRAIN
    resources_id: str | None = None
    timeout_seconds: float | None = None
    unresponsive_seconds: float | None = None
    max_attempts: int = 1
    retry_condition: tuple[AttemptStatus, ...] = ()
    metadata: dict[str, str] = field(default_factory=dict)


def make_rollout(
    task: Any, options: RolloutOptions, rollout_id: str | None = None
) -> RolloutQueued:
    """The RolloutQueued event for one task input; raises EnqueueError on a bad one."""
    try:
        encoded = json.dumps(task, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise EnqueueError(f"task input is not JSON-serialisable: {exc}") from None
    if len(encoded.encode()) > MAX_INPUT_BYTES:
        raise EnqueueError(
            f"task input is {len(encoded.encode()):,} bytes encoded, over the limit of "
            f"{MAX_INPUT_BYTES:,}; store large inputs elsewhere and pass a reference"
        )
    for name in ("timeout_seconds", "unresponsive_seconds"):
        seconds = getattr(options, name)
        if seconds is not None and not math.isfinite(seconds):
            raise EnqueueError(
                f"invalid rollout options: {name}: must be a finite number of seconds "
                f"(leave it unset for no limit), got {seconds}"
            )
    try:
        return RolloutQueued(
            rollout_id=rollout_id or f"ro-{uuid.uuid4().hex}",
            attempt_number=1,
            input_json=encoded,
            mode=options.mode,
            resources_id=options.resources_id,
            timeout_seconds=options.timeout_seconds,
            unresponsive_seconds=options.unresponsive_seconds,
            max_attempts=options.max_attempts,
            retry_condition=options.retry_condition,
            metadata=options.metadata,
        )
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise EnqueueError(f"invalid rollout options: {problems}") from None


CHUNK = 500  # rollouts per transaction
# How long the broker lets a keyed enqueue's transaction stay open before aborting it: a
# writer that died mid-transaction holds read_committed readers of its partitions back until
# then (a test whose broker halts mid-transaction passes a shorter one).
TRANSACTION_TIMEOUT_MS = 30_000
_INT32_MAX = 2**31 - 1  # the protocol's field


def batch_key(tasks: list[Any], options: RolloutOptions) -> str:
    """A key naming exactly these task inputs with these options (the CLI's default key: the
    same file queued again finds its rollouts queued)."""
    digest = hashlib.sha256()
    digest.update(json.dumps(dataclasses.asdict(options), sort_keys=True, default=str).encode())
    for task in tasks:
        digest.update(json.dumps(task, sort_keys=True, default=str).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def rollout_ids(key: str, count: int) -> list[str]:
    """The ids of a keyed enqueue: ro-<the first 16 hex digits of sha256(key)>-<index>."""
    prefix = hashlib.sha256(key.encode()).hexdigest()[:16]
    return [f"ro-{prefix}-{i}" for i in range(count)]


@dataclass(frozen=True)
class Enqueued:
    ids: list[str]
    queued_now: int  # 0 when an earlier run with the same key had queued them all


async def enqueue_batch(
    kafka: KafkaSettings,
    tasks: Iterable[Any],
    options: RolloutOptions | None = None,
    key: str | None = None,
    on_sent: Callable[[int], None] | None = None,
    ids: Sequence[str] | None = None,
    where: Sequence[str] | None = None,
    transaction_timeout_ms: int = TRANSACTION_TIMEOUT_MS,
) -> Enqueued:
    """Queue one rollout per task input, safe to run again with the same `key`.

    Rollout i's id is `ids[i]` when given, else `rollout_ids(key, n)[i]` (a task input that
    is a dict with a string "rollout_id" keeps that id). The rollouts go in transactions of
    CHUNK, each committing how many are queued (and a digest of the inputs and options) as
    the offset of the consumer group `<prefix>enqueue-<id prefix>`: a run cut off half-way
    leaves whole chunks (never a part of one), a run with the same key queues only what is
    not queued yet, and one with the same key but other inputs is refused; two at once fence
    each other. The count is kept as long as Kafka keeps committed offsets
    (offsets.retention.minutes, 7 days by default): after that, the same key queues the same
    ids again. Without a key: new rollouts with ids of their own, through a plain idempotent
    producer. A task input that cannot be queued is named in the error by its place in
    `where` (FILE:LINE from read_located_tasks), else by its number. A keyed run's
    transactions are aborted by the broker when open longer than `transaction_timeout_ms`
    (at most the broker's transaction.max.timeout.ms)."""
    if not 0 < transaction_timeout_ms <= _INT32_MAX:
        raise EnqueueError(
            f"transaction_timeout_ms must be a positive number of milliseconds (at most "
            f"{_INT32_MAX}), got {transaction_timeout_ms}"
        )
    options = options or RolloutOptions()
    tasks = list(tasks)
    if key is not None and not key.strip():
        raise EnqueueError(
            "an enqueue key cannot be empty: leave it out for a digest of the inputs"
        )
    if ids is None:
        derived = rollout_ids(key or uuid.uuid4().hex, len(tasks))
        ids = [_own_id(task) or i for task, i in zip(tasks, derived, strict=True)]
    elif len(ids) != len(tasks):
        raise EnqueueError(f"{len(ids)} ids for {len(tasks)} task inputs")
    events = []
    for index, (task, rollout_id) in enumerate(zip(tasks, ids, strict=True)):
        try:
            events.append(make_rollout(task, options, rollout_id))
        except EnqueueError as exc:
            place = where[index] if where is not None else f"task input {index + 1}"
            raise EnqueueError(f"{place}: {exc}") from None
    if key is None:
        return Enqueued(await _queue_fresh(kafka, events, on_sent), len(events))
    digest = batch_key(tasks, options)
    return await _queue_keyed(kafka, key, digest, events, on_sent, transaction_timeout_ms)


def _own_id(task: Any) -> str | None:
    own = task.get("rollout_id") if isinstance(task, dict) else None
    return own if isinstance(own, str) else None


async def _queue_fresh(
    kafka: KafkaSettings, events: list[RolloutQueued], on_sent: Callable[[int], None] | None
) -> list[str]:
    """New rollouts with ids of their own: nothing to resume, so no marker is kept."""
    async with producer(kafka, linger_ms=5) as client:
        publisher = EventPublisher(client, Topics(kafka))
        for start in range(0, len(events), CHUNK):
            chunk = events[start : start + CHUNK]
            sent = [await publisher.send("tasks", e) for e in chunk]
            await acknowledged(asyncio.gather(*sent), kafka, f"{len(chunk)} rollouts")
            if on_sent is not None:
                on_sent(len(chunk))
    return [e.rollout_id for e in events]


async def _queue_keyed(
    kafka: KafkaSettings,
    key: str,
    digest: str,
    events: list[RolloutQueued],
    on_sent: Callable[[int], None] | None,
    transaction_timeout_ms: int,
) -> Enqueued:
    topics = Topics(kafka)
    marker = TopicPartition(topics.name("tasks"), 0)
    group = f"{kafka.topic_prefix}enqueue-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    client = AIOKafkaProducer(
        acks="all", enable_idempotence=True, linger_ms=5, transactional_id=group,
        transaction_timeout_ms=transaction_timeout_ms,
        **(await reachable(kafka)).client_options(),
    )  # fmt: skip
    await started(client)  # fences a run with the same key still going
    async with stopping(client):
        done, before = await retrying(
            lambda: _queued_before(kafka, group, marker), "reading what was queued before"
        )
        if done and before != digest:
            raise EnqueueError(
                f"the key {key!r} already queued {done:,} rollouts of other task inputs or "
                "options; use another key (or --again) for these"
            )
        done = min(done, len(events))
        if on_sent is not None and done:
            on_sent(done)
        publisher = EventPublisher(client, topics)
        for start in range(done, len(events), CHUNK):
            chunk = events[start : start + CHUNK]
            await client.begin_transaction()
            sent = [await publisher.send("tasks", event) for event in chunk]
            note = json.dumps({"total": len(events), "digest": digest})
            progress = OffsetAndMetadata(start + len(chunk), note)
            marked = client.send_offsets_to_transaction({marker: progress}, group)
            await acknowledged(marked, kafka, "the queue's progress")
            await acknowledged(asyncio.gather(*sent), kafka, f"{len(chunk)} rollouts")
            await acknowledged(client.commit_transaction(), kafka, "the transaction's commit")
            if on_sent is not None:
                on_sent(len(chunk))
    return Enqueued([e.rollout_id for e in events], len(events) - done)


async def _queued_before(
    kafka: KafkaSettings, group: str, marker: TopicPartition
) -> tuple[int, str | None]:
    """How many rollouts the key queued, and the digest of the inputs it queued them for."""
    async with admin_client(kafka) as admin:
        offsets = await admin.list_consumer_group_offsets(group, partitions=[marker])
    found = offsets.get(marker)
    if found is None or found.offset <= 0:
        return 0, None
    try:
        return found.offset, str(json.loads(found.metadata or "{}").get("digest"))
    except (ValueError, AttributeError):
        return found.offset, None


async def enqueue(
    kafka: KafkaSettings,
    tasks: Iterable[Any],
    options: RolloutOptions | None = None,
    on_sent: Callable[[int], None] | None = None,
    key: str | None = None,
    transaction_timeout_ms: int = TRANSACTION_TIMEOUT_MS,
) -> list[str]:
    """Queue one rollout per task input; returns their rollout ids once the broker has them.
    With a `key`, running it again queues only what is not queued yet (enqueue_batch)."""
    queued = await enqueue_batch(
        kafka, tasks, options, key, on_sent, transaction_timeout_ms=transaction_timeout_ms
    )
    return queued.ids


def read_tasks(
    path: Path | None, fmt: str | None = None, stdin: IO[str] | None = None
) -> Iterator[Any]:
    """Task inputs from a JSONL, JSON (a list) or Parquet file, or JSONL on stdin."""
    for _, task in read_located_tasks(path, fmt, stdin):
        yield task


def read_located_tasks(
    path: Path | None, fmt: str | None = None, stdin: IO[str] | None = None
) -> Iterator[tuple[str, Any]]:
    """read_tasks, each task input with its place for error messages: FILE:LINE in JSONL,
    FILE item N in JSON, FILE row N in Parquet (counted from 1)."""
    try:
        yield from _read_tasks(path, fmt, stdin)
    except UnicodeDecodeError as exc:
        bad = exc.object[exc.start]
        raise EnqueueError(
            f"{path or '<stdin>'}: not UTF-8 text (byte {exc.start} is 0x{bad:02x})"
        ) from None


def _read_tasks(
    path: Path | None, fmt: str | None, stdin: IO[str] | None
) -> Iterator[tuple[str, Any]]:
    kind = fmt or (_format_of(path) if path else "jsonl")
    if kind == "parquet":
        if path is None:
            raise EnqueueError("Parquet cannot be read from standard input; give a file")
        yield from _parquet(path)
        return
    if path is None:
        assert stdin is not None
        yield from _jsonl(stdin, "<stdin>")
        return
    with path.open(encoding="utf-8") as handle:
        if kind == "json":
            try:
                data = json.load(handle)
            except json.JSONDecodeError as exc:
                raise EnqueueError(f"{path}: not valid JSON ({exc})") from None
            if not isinstance(data, list):
                raise EnqueueError(f"{path}: a JSON file must hold a list of task inputs")
            for number, task in enumerate(data, start=1):
                yield f"{path} item {number}", task
        else:
            yield from _jsonl(handle, str(path))


def _format_of(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix == ".json":
        return "json"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise EnqueueError(
        f"{path}: unknown file type {suffix!r}; use .jsonl, .json or .parquet, or --format"
    )


def _jsonl(handle: IO[str], name: str) -> Iterator[tuple[str, Any]]:
    for number, line in enumerate(handle, start=1):
        if not line.strip():
            continue
        try:
            task = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EnqueueError(f"{name}:{number}: not valid JSON ({exc.msg})") from None
        yield f"{name}:{number}", task


def _parquet(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise EnqueueError("reading Parquet needs pyarrow: pip install pyarrow") from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises many kinds
        raise EnqueueError(f"{path}: not a readable Parquet file ({exc})") from None
    for number, row in enumerate(table.to_pylist(), start=1):
        yield f"{path} row {number}", row
