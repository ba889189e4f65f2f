"""Projection throughput: a large generated event stream into PostgreSQL, beside a raw COPY
of the same span rows as the ceiling, and the projection lag under a steady load.

    .venv/bin/python -m benchmarks.projector --spans 1000000 --projectors 1

Rollouts shaped like the runner benchmark's synthetic agent (1-10 rounds; per round a span
with two children carrying 2-6 attributes of 5-300 character strings, a reward in half of
the rounds; a final span and reward) and their lifecycle events go to fresh topics; then
the projector processes start on a fresh database and the clock runs from their first
commit until every record is projected. The COPY ceiling copies the same span rows into a
table shaped like the read model's spans table (same primary key) in batches of the same
size, in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Iterator

import asyncpg
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from agl_stream.bus.kafka import producer
from agl_stream.bus.streams import EventPublisher, Topics
from agl_stream.db.migrate import FIRST_READ_MODEL, migrate
from agl_stream.embedded.stack import StackState
from agl_stream.events import (
    AttemptFinished,
    AttemptStarted,
    AttemptStatus,
    Event,
    RolloutFinished,
    RolloutMode,
    RolloutQueued,
    RolloutStatus,
    SpanRecorded,
)
from agl_stream.projection.copy_binary import COLUMNS as COPY_COLUMNS
from agl_stream.projection.copy_binary import copy_data
from agl_stream.projection.fold import span_row
from agl_stream.projection.rows import SpanRow, columns, values
from agl_stream.projection.store import connect
from agl_stream.runtime.config import (
    DatabaseSettings,
    KafkaSettings,
    child_environment,
    load,
)
from benchmarks.runners import sample, stack_cpu
from benchmarks.stack import benchmark_parser, fresh_topics, key_value_table, run_benchmark
from benchmarks.synthetic import _flat, attributes

console = Console()
Item = tuple[str, Event]


def rollout(rng: random.Random, index: int, run: str) -> list[Item]:
    rollout_id, attempt_id = f"{run}-{index:07d}", f"{run}-{index:07d}-a1"
    trace = f"{rng.getrandbits(128):032x}"
    out: list[Item] = [
        ("tasks", RolloutQueued(
            rollout_id=rollout_id, attempt_number=1, input_json='{"seed": 1}',
            mode=RolloutMode.TRAIN,
        )),
        ("rollouts", AttemptStarted(
            rollout_id=rollout_id, attempt_id=attempt_id, attempt_number=1, worker_id="bench",
        )),
    ]  # fmt: skip
    names: list[tuple[str, dict[str, object]]] = []
    for number in range(rng.randint(1, 10)):
        names.append(("round", {"round": number}))
        names.append(("llm.call", _flat(attributes(rng))))
        names.append(("tool.call", _flat(attributes(rng))))
        if number % 2 == 0:
            names.append(("agl.reward", {"agl.reward": rng.random()}))
    names += [("final", {"rounds": len(names)}), ("agl.reward", {"agl.reward": rng.random()})]
    now = time.time_ns()
    for sequence, (name, attrs) in enumerate(names):
        out.append(("spans", SpanRecorded(
            rollout_id=rollout_id, attempt_id=attempt_id, sequence=sequence, trace_id=trace,
            span_id=f"{rng.getrandbits(64):016x}", name=name, start_time_unix_nano=now,
            end_time_unix_nano=now + 1000, attributes=attrs,
        )))  # fmt: skip
    out += [
        ("rollouts", AttemptFinished(
            rollout_id=rollout_id, attempt_id=attempt_id, attempt_number=1, worker_id="bench",
            status=AttemptStatus.SUCCEEDED, span_count=len(names), reward=1.0,
        )),
        ("rollouts", RolloutFinished(
            rollout_id=rollout_id, status=RolloutStatus.SUCCEEDED, attempt_id=attempt_id,
            attempt_count=1,
        )),
    ]  # fmt: skip
    return out


def stream(seed: int, run: str, spans: int) -> Iterator[list[Item]]:
    """Rollouts until `spans` spans; the same seed gives the same rows."""
    rng = random.Random(seed)
    made = index = 0
    while made < spans:
        items = rollout(rng, index, run)
        made += sum(1 for t, _ in items if t == "spans")
        index += 1
        yield items


async def produce(kafka: KafkaSettings, seed: int, run: str, spans: int) -> tuple[int, int]:
    """Publish the stream; (records, spans) sent."""
    records = sent_spans = 0
    columns_ = (TextColumn("producing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns_, console=console, transient=True) as progress:
        bar = progress.add_task("spans", total=spans)
        async with producer(kafka, linger_ms=20, max_batch_size=1 << 20) as prod:
            publisher = EventPublisher(prod, Topics(kafka))
            pending: list[asyncio.Future[object]] = []
            for items in stream(seed, run, spans):
                for topic, event in items:
                    pending.append(await publisher.send(topic, event))
                records += len(items)
                n = sum(1 for t, _ in items if t == "spans")
                sent_spans += n
                progress.advance(bar, n)
                if len(pending) > 20_000:
                    await asyncio.gather(*pending)
                    pending.clear()
            await asyncio.gather(*pending)
    return records, sent_spans


async def projected(conn: asyncpg.Connection, schema: str) -> tuple[int, int]:
    """(records, spans records) the projection has passed."""
    rows = await conn.fetch(f'SELECT topic, next_offset FROM "{schema}".projector_offsets')
    total = sum(r["next_offset"] for r in rows)
    spans = sum(r["next_offset"] for r in rows if r["topic"].endswith(".spans"))
    return total, spans


async def project(
    state: StackState,
    kafka: KafkaSettings,
    database: DatabaseSettings,
    args: argparse.Namespace,
    records: int,
) -> dict[str, object]:
    env = child_environment(kafka, database)
    processes = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agl_stream.cli.main", "worker", "projector",
            "--batch-size", str(args.batch), "--worker-id", f"bench-projector-{i}",
            "--heartbeat", "60", env=env, stdout=asyncio.subprocess.DEVNULL,
        )
        for i in range(args.projectors)
    ]  # fmt: skip
    conn = await connect(database.asyncpg_dsn)
    try:
        start_samples = {p.pid: sample(p.pid) for p in processes}
        stack_start = stack_cpu(state)
        t0 = c0 = s0 = None
        columns_ = (
            TextColumn("projecting"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        with Progress(*columns_, console=console, transient=True) as progress:
            bar = progress.add_task("records", total=records)
            while True:
                done, spans = await projected(conn, FIRST_READ_MODEL)
                now = time.monotonic()
                if t0 is None and done > 0:
                    t0, c0, s0 = now, done, spans
                    start_samples = {p.pid: sample(p.pid) for p in processes}
                    stack_start = stack_cpu(state)
                progress.update(bar, completed=done)
                if done >= records:
                    t1 = now
                    break
                await asyncio.sleep(0.2)
        end_samples = {p.pid: sample(p.pid) for p in processes}
        stack_end = stack_cpu(state)
        assert t0 is not None
        assert c0 is not None
        assert s0 is not None
        elapsed = t1 - t0
        steady = await steady_load(kafka, conn, args, records) if args.steady_seconds else {}
    finally:
        for p in processes:
            p.send_signal(signal.SIGTERM)
        await asyncio.gather(*(p.wait() for p in processes))
        await conn.close()
    return {
        "seconds": round(elapsed, 2),
        "records_per_s": round((records - c0) / elapsed),
        "spans_per_s": round((args.spans_sent - s0) / elapsed),
        "projector_cpu_s": [
            round(end_samples[p.pid].cpu_seconds - start_samples[p.pid].cpu_seconds, 1)
            for p in processes
        ],
        **{f"{name}_cpu_s": round(stack_end[name] - stack_start[name], 1) for name in stack_end},
        "projector_peak_rss_mb": [round(end_samples[p.pid].peak_rss_mb, 1) for p in processes],
        **steady,
    }


async def steady_load(
    kafka: KafkaSettings, conn: asyncpg.Connection, args: argparse.Namespace, start: int
) -> dict[str, object]:
    """Publish about args.rate spans/s for args.steady_seconds; sample the lag (records
    published and acknowledged, not yet projected) twice a second."""
    sent = start
    lags: list[int] = []
    rollouts = stream(args.seed + 1, f"steady{uuid.uuid4().hex[:4]}", 1 << 60)
    async with producer(kafka, linger_ms=5) as prod:
        publisher = EventPublisher(prod, Topics(kafka))
        begin = time.monotonic()
        next_sample = begin
        spans_sent = 0
        with console.status(f"steady load, {args.rate} spans/s for {args.steady_seconds} s..."):
            while time.monotonic() - begin < args.steady_seconds:
                due = args.rate * (time.monotonic() - begin)
                futures = []
                while spans_sent < due:
                    items = next(rollouts)
                    futures += [await publisher.send(t, e) for t, e in items]
                    spans_sent += sum(1 for t, _ in items if t == "spans")
                await asyncio.gather(*futures)
                sent += len(futures)
                if time.monotonic() >= next_sample:
                    done, _ = await projected(conn, FIRST_READ_MODEL)
                    lags.append(max(0, sent - done))
                    next_sample += 0.5
                await asyncio.sleep(0.05)
        duration = time.monotonic() - begin
    records_per_s = (sent - start) / duration
    return {
        "steady_spans_per_s": round(spans_sent / duration),
        "steady_lag_records_p50": int(statistics.median(lags)),
        "steady_lag_records_max": max(lags),
        # records behind / records arriving per second: how old the newest projected row is
        "steady_lag_seconds_p50": round(statistics.median(lags) / records_per_s, 3),
        "steady_lag_seconds_max": round(max(lags) / records_per_s, 3),
    }


async def copy_ceiling(
    database: DatabaseSettings, args: argparse.Namespace, binary: bool = False
) -> dict[str, object]:
    """COPY the same span rows into a table like the read model's spans (same key): as the
    issue defines the ceiling, asyncpg's COPY of the rows (its encoding timed with it); with
    `binary`, the rows encoded beforehand in binary COPY format (copy_binary), outside the
    timing: PostgreSQL's own rate of taking them."""
    conn = await connect(database.asyncpg_dsn)
    elapsed = 0.0
    rows = 0
    copy = _copy_binary if binary else _copy
    try:
        await conn.execute("DROP TABLE IF EXISTS public.copy_ceiling")
        await conn.execute(
            f'CREATE TABLE public.copy_ceiling (LIKE "{FIRST_READ_MODEL}".spans INCLUDING ALL)'
        )
        batch: list[SpanRow] = []
        for items in stream(args.seed, args.run, args.spans):
            batch += [span_row(e) for t, e in items if isinstance(e, SpanRecorded)]
            if len(batch) >= args.batch:
                elapsed += await copy(conn, batch)
                rows += len(batch)
                batch = []
        if batch:
            elapsed += await copy(conn, batch)
            rows += len(batch)
        await conn.execute("DROP TABLE public.copy_ceiling")
    finally:
        await conn.close()
    name = "binary_copy" if binary else "copy"
    return {
        f"{name}_rows": rows,
        f"{name}_seconds": round(elapsed, 2),
        f"{name}_rows_per_s": round(rows / elapsed),
    }


async def _copy(conn: asyncpg.Connection, batch: list[SpanRow]) -> float:
    records = [values(s) for s in batch]
    start = time.perf_counter()
    async with conn.transaction():
        await conn.copy_records_to_table(
            "copy_ceiling", schema_name="public", columns=columns(SpanRow), records=records
        )
    return time.perf_counter() - start


async def _copy_binary(conn: asyncpg.Connection, batch: list[SpanRow]) -> float:
    data = memoryview(copy_data(batch))
    start = time.perf_counter()
    async with conn.transaction():
        await conn.copy_to_table(
            "copy_ceiling", schema_name="public", columns=COPY_COLUMNS, source=data,
            format="binary",
        )  # fmt: skip
    return time.perf_counter() - start


async def checkpoint(database: DatabaseSettings) -> None:
    """Both measurements start from a database with no dirty pages to write: otherwise a
    checkpoint of what the previous phase wrote runs during (and slows) the next one."""
    conn = await connect(database.asyncpg_dsn)
    try:
        await conn.execute("CHECKPOINT")
    finally:
        await conn.close()


async def main(args: argparse.Namespace) -> dict[str, object]:
    args.run = f"b{uuid.uuid4().hex[:6]}"
    state, kafka = await fresh_topics(args.run)
    database = load(DatabaseSettings, database_url=state.database_url).with_database(
        f"bench_{args.run}"
    )
    await migrate(database)
    records, args.spans_sent = await produce(kafka, args.seed, args.run, args.spans)
    await checkpoint(database)
    projection = await project(state, kafka, database, args, records)
    await checkpoint(database)
    ceiling = await copy_ceiling(database, args)
    await checkpoint(database)
    binary = await copy_ceiling(database, args, binary=True)
    spans_per_s = int(projection["spans_per_s"])  # type: ignore[call-overload]
    result: dict[str, object] = {
        "spans": args.spans_sent, "records": records, "projectors": args.projectors,
        "batch": args.batch, **projection, **ceiling, **binary,
        "projection_to_copy_ratio": round(spans_per_s / int(ceiling["copy_rows_per_s"]), 3),  # type: ignore[call-overload]
        "projection_to_binary_copy_ratio": round(
            spans_per_s / int(binary["binary_copy_rows_per_s"]), 3  # type: ignore[call-overload]
        ),
    }  # fmt: skip
    admin = await asyncpg.connect(database.with_database("postgres").asyncpg_dsn)
    try:
        await admin.execute(f'DROP DATABASE "bench_{args.run}" WITH (FORCE)')
    finally:
        await admin.close()
    return result


def report(result: dict[str, object]) -> None:
    console.print(key_value_table("projection benchmark", result))


if __name__ == "__main__":
    parser = benchmark_parser(__doc__)
    parser.add_argument("--spans", type=int, default=1_000_000)
    parser.add_argument("--projectors", type=int, default=1)
    parser.add_argument("--batch", type=int, default=5000, help="records per transaction")
    parser.add_argument("--rate", type=int, default=2000, help="spans/s of the steady load")
    parser.add_argument("--steady-seconds", type=float, default=20)
    parser.add_argument("--seed", type=int, default=1)
    run_benchmark(parser, main, report)
