"""Putting rollouts on the tasks topic: from Python, and from JSONL, JSON or Parquet files."""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from pydantic import ValidationError

from agl_stream.config import KafkaSettings
from agl_stream.events import AttemptStatus, RolloutMode, RolloutQueued
from agl_stream.kafka import producer
from agl_stream.streams import EventPublisher, Topics

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


async def enqueue(
    kafka: KafkaSettings,
    tasks: Iterable[Any],
    options: RolloutOptions | None = None,
    on_sent: Callable[[int], None] | None = None,
) -> list[str]:
    """Queue one rollout per task input; returns their rollout ids once the broker has them.
    A task input that is a dict with a string "rollout_id" keeps that id."""
    options = options or RolloutOptions()
    ids: list[str] = []
    async with producer(kafka, linger_ms=5) as prod:
        publisher = EventPublisher(prod, Topics(kafka))
        pending = []
        for task in tasks:
            rollout_id = task.get("rollout_id") if isinstance(task, dict) else None
            event = make_rollout(task, options, rollout_id if isinstance(rollout_id, str) else None)
            pending.append(await publisher.send("tasks", event))
            ids.append(event.rollout_id)
            if len(pending) >= 500:
                await _settle(pending, on_sent)
        await _settle(pending, on_sent)
    return ids


async def _settle(pending: list[Any], on_sent: Callable[[int], None] | None) -> None:
    for future in pending:
        await future
    if on_sent is not None:
        on_sent(len(pending))
    pending.clear()


def read_tasks(
    path: Path | None, fmt: str | None = None, stdin: IO[str] | None = None
) -> Iterator[Any]:
    """Task inputs from a JSONL, JSON (a list) or Parquet file, or JSONL on stdin."""
    try:
        yield from _read_tasks(path, fmt, stdin)
    except UnicodeDecodeError as exc:
        bad = exc.object[exc.start]
        raise EnqueueError(
            f"{path or '<stdin>'}: not UTF-8 text (byte {exc.start} is 0x{bad:02x})"
        ) from None


def _read_tasks(path: Path | None, fmt: str | None, stdin: IO[str] | None) -> Iterator[Any]:
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
            yield from data
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


def _jsonl(handle: IO[str], name: str) -> Iterator[Any]:
    for number, line in enumerate(handle, start=1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as exc:
            raise EnqueueError(f"{name} line {number}: not valid JSON ({exc.msg})") from None


def _parquet(path: Path) -> Iterator[Any]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise EnqueueError("reading Parquet needs pyarrow: pip install pyarrow") from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises many kinds
        raise EnqueueError(f"{path}: not a readable Parquet file ({exc})") from None
    yield from table.to_pylist()
