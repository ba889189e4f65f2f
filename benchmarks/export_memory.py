"""`agl-stream export` on a large read model: its peak memory stays flat as the export grows.

Fills a fresh database on the embedded stack (started if it is not running) with attempts of
two LLM calls each, every call span about 1.5 KB of attributes as the gateway records them
(messages, completion, 48 prompt and 16 response token ids with logprobs), written in
PostgreSQL by generate_series; then runs `agl-stream export` as a process for each size and
kind, and reads its peak RSS from the kernel (wait4's ru_maxrss). Sizes run side by side in
one run.

    python -m benchmarks.export_memory --spans 100000 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
from rich.console import Console
from rich.table import Table

from agl_stream.db.migrate import FIRST_READ_MODEL, migrate
from agl_stream.embedded.stack import EmbeddedStack
from agl_stream.runtime.config import DatabaseSettings, StackSettings, load
from benchmarks.stack import benchmark_parser, run_benchmark

CALLS = 2  # per attempt

_FILL = """
INSERT INTO "{rm}".rollouts (rollout_id, status, mode, input, metadata, queued_attempt,
    attempt_count, updated_at, finished_at, reward)
SELECT 'r' || i, 'succeeded', 'train', jsonb_build_object('q', i % 100),
       jsonb_build_object('group', 'g' || (i % 100)), 1, 1, now(), now(), (i % 10) / 10.0
FROM generate_series({start}, {stop} - 1) i;
INSERT INTO "{rm}".attempts (rollout_id, attempt_id, attempt_number, status, worker_id,
    finished_at, finished_status, span_count, reward)
SELECT 'r' || i, 'a' || i, 1, 'succeeded', 'w', now(), 'succeeded', {calls}, (i % 10) / 10.0
FROM generate_series({start}, {stop} - 1) i;
INSERT INTO "{rm}".spans (rollout_id, attempt_id, sequence, event_id, recorded_at, trace_id,
    span_id, name, kind, start_time, end_time, start_time_unix_nano, end_time_unix_nano,
    status_code, attributes, events, links, resource)
SELECT 'r' || i, 'a' || i, c, gen_random_uuid(), now(), lpad(to_hex(i), 32, '0'),
       lpad(to_hex(i * 4 + c), 16, '0'), 'agl.llm.call', 'CLIENT', now(), now(), c, c + 1,
       'OK',
       jsonb_build_object(
         'gen_ai.prompt.json', jsonb_build_object('messages', jsonb_build_array(
            jsonb_build_object('role', 'system', 'content', repeat('You are helpful. ', 8)),
            jsonb_build_object('role', 'user', 'content', 'question ' || i)))::text,
         'gen_ai.completion', 'answer ' || i || ' ' || repeat('word ', 12),
         'agl.llm.prompt_token_ids', (SELECT jsonb_agg(t) FROM generate_series(1, 48) t),
         'agl.llm.response_token_ids', (SELECT jsonb_agg(t) FROM generate_series(1, 16) t),
         'agl.llm.response_logprobs',
            (SELECT jsonb_agg(-0.125 * t) FROM generate_series(1, 16) t)),
       '[]', '[]', '{{}}'
FROM generate_series({start}, {stop} - 1) i, generate_series(0, {calls} - 1) c;
"""


async def fill(database: DatabaseSettings, attempts: int, have: int) -> None:
    conn = await asyncpg.connect(database.asyncpg_dsn)
    try:
        step = 50_000
        for start in range(have, attempts, step):
            stop = min(attempts, start + step)
            await conn.execute(
                _FILL.format(rm=FIRST_READ_MODEL, start=start, stop=stop, calls=CALLS)
            )
    finally:
        await conn.close()


def export_peak(database: DatabaseSettings, kind: str, fmt: str, out: Path) -> dict[str, Any]:
    """One `agl-stream export` process: its seconds, peak RSS and output size."""
    command = [
        sys.executable, "-m", "agl_stream.cli.main",
        "--database-url", database.database_url.get_secret_value(),
        "export", "--kind", kind, "--format", fmt, "-o", str(out),
    ]  # fmt: skip
    began = time.monotonic()
    process = subprocess.Popen(command, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.monotonic() - began
    process.returncode = os.waitstatus_to_exitcode(status)
    error = process.stderr.read().decode() if process.stderr else ""
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {error}")
    return {
        "kind": kind, "format": fmt, "seconds": round(seconds, 1),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
        "output_mb": round(out.stat().st_size / 2**20, 1), "said": error.strip(),
    }  # fmt: skip


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    stack = EmbeddedStack(load(StackSettings))
    state = stack.running() or stack.up()
    name = f"bench_export_{uuid.uuid4().hex[:8]}"
    database = load(DatabaseSettings, database_url=state.database_url).with_database(name)
    await migrate(database)
    rows: list[dict[str, Any]] = []
    try:
        have = 0
        with tempfile.TemporaryDirectory() as tmp:
            for spans in sorted(args.spans):
                attempts = spans // CALLS
                began = time.monotonic()
                await fill(database, attempts, have)
                have = attempts
                filled = round(time.monotonic() - began, 1)
                for kind, fmt in (("transcripts", "jsonl"), ("triplets", "parquet")):
                    out = Path(tmp) / f"{kind}.{fmt}"
                    figures = await asyncio.to_thread(export_peak, database, kind, fmt, out)
                    rows.append({"spans": spans, "attempts": attempts, "fill_s": filled, **figures})
                    out.unlink()
    finally:
        admin = await asyncpg.connect(database.with_database("postgres").asyncpg_dsn)
        try:
            await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        finally:
            await admin.close()
    return rows


def report(rows: list[dict[str, Any]]) -> None:
    table = Table(title="agl-stream export: peak RSS by size (one run)", title_justify="left")
    for column in ("spans", "attempts", "kind", "format", "seconds", "peak RSS MB", "output MB"):
        table.add_column(column)
    for r in rows:
        table.add_row(
            f"{r['spans']:,}", f"{r['attempts']:,}", r["kind"], r["format"], str(r["seconds"]),
            str(r["peak_rss_mb"]), str(r["output_mb"]),
        )  # fmt: skip
    Console().print(table)


if __name__ == "__main__":
    parser = benchmark_parser(__doc__)
    parser.add_argument("--spans", type=int, nargs="+", default=[100_000, 1_000_000])
    run_benchmark(parser, main, report)
