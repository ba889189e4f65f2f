"""The dashboard on a big read model: --rollouts rollouts with --spans spans each (1M and 20
by default: 20M spans), a long training run's versions and a fleet of workers, written into a
database of its own by PostgreSQL itself (generate_series: filling through the projector
would take hours and measures the projector, which benchmarks.projector does). Then the
dashboard runs as its own process (`agl-stream dashboard`) and each page's API calls are
timed one after the other, with varied arguments: p50, p95 and the slowest, in ms.

    .venv/bin/python -m benchmarks.dashboard                      # 1M rollouts, 20M spans
    .venv/bin/python -m benchmarks.dashboard --rollouts 20000     # a quick look

The filled database is kept (its name says its size) and found again by a later run of the
same size; --refill fills it anew. It needs ~1.2 GB of disk per million spans.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import asyncpg
from rich.console import Console
from rich.table import Table

from agl_stream.db.migrate import migrate
from agl_stream.embedded.process import free_port
from agl_stream.queries import ReadModel
from agl_stream.runtime.config import DatabaseSettings, load
from benchmarks.stack import benchmark_parser, fresh_topics, run_benchmark

console = Console()
RUNNERS = 16
BATCHES = 1_000
VERSIONS = 500
SPAN_CHUNK = 100_000  # rollouts per INSERT of spans (a transaction of its own)

FILL_ROLLOUTS = """
INSERT INTO {s}.rollouts (rollout_id, status, mode, input, metadata, max_attempts,
    retry_condition, first_queued_at, queued_attempt, queued_at, attempt_count,
    latest_attempt_id, worker_id, attempt_resources_id, started_at, finished_status,
    finished_at, reward, updated_at)
SELECT 'ro-' || lpad(i::text, 9, '0'),
    st, CASE WHEN i % 10 = 0 THEN 'val' ELSE 'train' END,
    jsonb_build_object('question', 'What is ' || i || ' + ' || (i % 97) || '?',
        'answer', i + i % 97),
    jsonb_build_object('batch', (i % {batches})::text,
        'split', CASE WHEN i % 3 = 0 THEN 'a' ELSE 'b' END),
    2, ARRAY['failed'], q, 1, q, CASE WHEN i % 10 = 7 THEN 2 ELSE 1 END,
    'at-' || i || '-' || CASE WHEN i % 10 = 7 THEN 2 ELSE 1 END,
    'runner-' || (i % {runners}), 'run-v' || (1 + i % {versions}), q + interval '1 second',
    CASE WHEN st IN ('succeeded', 'failed') THEN st END,
    CASE WHEN st IN ('succeeded', 'failed') THEN q + interval '3 seconds' END,
    CASE WHEN st = 'succeeded' THEN (i % 1000) / 1000.0 END,
    q + interval '3 seconds'
FROM (SELECT i, now() - (({n} - i) * interval '2.6 seconds') AS q,
        CASE WHEN i % 100 < 90 THEN 'succeeded' WHEN i % 100 < 95 THEN 'failed'
             WHEN i % 100 < 98 THEN 'running' ELSE 'queuing' END AS st
      FROM generate_series(1, {n}) AS i) AS g
"""

FILL_ATTEMPTS = """
INSERT INTO {s}.attempts (rollout_id, attempt_id, attempt_number, status, worker_id,
    resources_id, started_at, finished_at, finished_status, span_count, reward)
SELECT r.rollout_id, 'at-' || substr(r.rollout_id, 4)::int || '-' || a, a,
    CASE WHEN a < r.attempt_count THEN 'failed' ELSE COALESCE(r.finished_status, 'running') END,
    r.worker_id, r.attempt_resources_id, r.started_at, r.finished_at,
    CASE WHEN a < r.attempt_count THEN 'failed' ELSE r.finished_status END, {spans}, r.reward
FROM {s}.rollouts r, generate_series(1, r.attempt_count) AS a
"""

# The latest attempt's spans: the attempt span, LLM calls with a chat and logprobs, tool
# spans and a reward, parented as the runner records them.
FILL_SPANS = """
INSERT INTO {s}.spans (rollout_id, attempt_id, sequence, event_id, recorded_at, trace_id,
    span_id, parent_span_id, name, kind, start_time, end_time, start_time_unix_nano,
    end_time_unix_nano, status_code, attributes, events, links, resource, scope_name)
SELECT r.rollout_id, r.latest_attempt_id, k, gen_random_uuid(), r.started_at,
    md5(r.rollout_id), substr(md5(r.rollout_id || k), 1, 16),
    CASE WHEN k = 0 THEN NULL ELSE substr(md5(r.rollout_id || 0), 1, 16) END,
    CASE WHEN k = 0 THEN 'agl.attempt' WHEN k = {spans} - 1 THEN 'agl.reward'
         WHEN k % 3 = 1 THEN 'agl.llm.call' ELSE 'tool.search' END,
    'internal', r.started_at + k * interval '10 ms', r.started_at + (k + 1) * interval '10 ms',
    0, 0, 'UNSET',
    CASE WHEN k % 3 = 1 THEN jsonb_build_object(
            'gen_ai.prompt.json', '{{"messages": [{{"role": "user", "content": "'
                || (r.input->>'question')
                || ' Think step by step and answer with a number."}}]}}',
            'gen_ai.completion', 'Adding the two numbers gives ' || (r.input->>'answer') || '.',
            'gen_ai.usage.input_tokens', 24, 'gen_ai.usage.output_tokens', 9,
            'agl.llm.response_logprobs',
                '[-0.1, -0.2, -0.05, -1.3, -0.4, -0.01, -0.2, -0.3, -0.1]'::jsonb,
            'agl.llm.resources_id', r.attempt_resources_id)
         WHEN k = {spans} - 1 THEN jsonb_build_object('agl.reward', r.reward)
         ELSE jsonb_build_object('tool.query', 'step ' || k || ' of ' || r.rollout_id,
            'tool.hits', k)
    END,
    '[]', '[]', '{{"service.name": "agent"}}', 'agl_stream'
FROM {s}.rollouts r, generate_series(0, {spans} - 1) AS k
WHERE r.rollout_id > $1 AND r.rollout_id <= $2
"""

FILL_RESOURCES = """
INSERT INTO {s}.resources (resources_id, version, resources, published_by, parent_resources_id,
    metadata, published_at, event_id)
SELECT 'run-v' || v, v,
    jsonb_build_object('prompt', jsonb_build_object(
        'template', 'Solve: {{question}} (v' || v || ')', 'engine', 'f_string')),
    'trainer', CASE WHEN v > 1 THEN 'run-v' || (v - 1) END,
    jsonb_build_object('run_name', 'big-run', 'step', v::text, 'samples', '64',
        'mean_reward', (0.2 + 0.7 * v / {versions})::text),
    now() - ({versions} - v) * interval '1 minute', gen_random_uuid()
FROM generate_series(1, {versions}) AS v
"""

FILL_WORKERS = """
INSERT INTO {s}.workers (worker_id, role, status, hostname, pid, current_rollouts, counts,
    interval_seconds, first_seen_at, last_heartbeat_at, event_id)
SELECT 'runner-' || w, 'runner', 'busy', 'host-' || w, 1000 + w,
    ARRAY['ro-' || lpad((w * 7)::text, 9, '0')],
    jsonb_build_object('lag', w, 'attempts_succeeded', 1000 * w),
    5, now() - interval '1 day', now(), gen_random_uuid()
FROM generate_series(0, {runners} - 1) AS w
"""


async def filled(database: DatabaseSettings, rollouts: int, spans: int, refill: bool) -> str:
    """The read model's schema, filled with this size (kept from an earlier run if it is)."""
    await migrate(database)
    async with ReadModel.open(database) as model:
        schema = model.schema
    conn = await asyncpg.connect(database.asyncpg_dsn)
    try:
        # A fill that was cut off is not taken for a whole one: only a finished fill marks it.
        await conn.execute("CREATE TABLE IF NOT EXISTS bench_filled (size text PRIMARY KEY)")
        size_name = f"{schema}:{rollouts}x{spans}"
        done = await conn.fetchval("SELECT 1 FROM bench_filled WHERE size = $1", size_name)
        if done and not refill:
            console.print(f"using the filled read model ({rollouts:,} rollouts)")
            return schema
        await conn.execute("DELETE FROM bench_filled")
        for table in ("spans", "attempts", "rollouts", "resources", "workers"):
            await conn.execute(f"TRUNCATE {schema}.{table}")
        size = {"s": schema, "n": rollouts, "spans": spans, "batches": BATCHES,
                "runners": RUNNERS, "versions": VERSIONS}  # fmt: skip
        started = time.monotonic()
        for name, sql in [("rollouts", FILL_ROLLOUTS), ("attempts", FILL_ATTEMPTS),
                          ("resources", FILL_RESOURCES), ("workers", FILL_WORKERS)]:  # fmt: skip
            await conn.execute(sql.format(**size))
            console.print(f"filled {name} ({time.monotonic() - started:.0f} s)")
        fill_spans = FILL_SPANS.format(**size)
        for low in range(0, rollouts, SPAN_CHUNK):
            bounds = (f"ro-{low:09d}", f"ro-{min(low + SPAN_CHUNK, rollouts):09d}")
            await conn.execute(fill_spans, *bounds)
            done = min(low + SPAN_CHUNK, rollouts) * spans
            console.print(f"filled {done:,} spans ({time.monotonic() - started:.0f} s)")
        await conn.execute(f"ANALYZE {schema}.rollouts, {schema}.attempts, {schema}.spans")
        await conn.execute("INSERT INTO bench_filled VALUES ($1)", size_name)
        return schema
    finally:
        await conn.close()


Call = Callable[[random.Random], tuple[str, dict[str, Any]]]


def calls(rollouts: int, cursor_of: dict[str, str]) -> dict[str, Call]:
    """What each page asks for, with varied arguments."""

    def some_id(rng: random.Random) -> str:
        return f"ro-{rng.randint(1, rollouts):09d}"

    def page(**params: str) -> tuple[str, dict[str, Any]]:
        return "/api/rollouts", {"descending": "true", "limit": "50", **params}

    return {
        "overview (every page)": lambda rng: ("/api/overview", {}),
        "runs": lambda rng: ("/api/runs", {}),
        "rollouts: first page": lambda rng: page(),
        "rollouts: a status": lambda rng: page(status=rng.choice(["failed", "running", "queuing"])),
        "rollouts: status and mode": lambda rng: page(status="succeeded", mode="val"),
        "rollouts: metadata": lambda rng: page(metadata=f"batch={rng.randrange(BATCHES)}"),
        "rollouts: a worker": lambda rng: page(worker_id=f"runner-{rng.randrange(RUNNERS)}"),
        "rollouts: next page": lambda rng: page(cursor=cursor_of["first"]),
        "a rollout": lambda rng: (f"/api/rollouts/{some_id(rng)}", {}),
        "a rollout's spans": lambda rng: (f"/api/rollouts/{some_id(rng)}/spans", {}),
        "workers": lambda rng: ("/api/workers", {}),
        "resources": lambda rng: ("/api/resources", {"limit": "200"}),
    }


async def timed(http: aiohttp.ClientSession, url: str, params: dict[str, Any]) -> float:
    started = time.perf_counter()
    async with http.get(url, params=params) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{url} {params}: {response.status} {await response.text()}")
    return (time.perf_counter() - started) * 1000


async def measure(url: str, rollouts: int, repeats: int) -> dict[str, dict[str, float]]:
    rng = random.Random(0)
    async with aiohttp.ClientSession() as http:
        async with http.get(
            f"{url}/api/rollouts", params={"descending": "true", "limit": "50"}
        ) as r:
            cursor = {"first": (await r.json())["next_cursor"]}
        figures = {}
        for name, call in calls(rollouts, cursor).items():
            path, params = call(rng)
            await timed(http, url + path, params)  # warm: plans cached, pages in memory
            ms = [await timed(http, url + p, q) for p, q in (call(rng) for _ in range(repeats))]
            ms.sort()
            figures[name] = {
                "p50_ms": round(statistics.median(ms), 1),
                "p95_ms": round(ms[max(0, int(len(ms) * 0.95) - 1)], 1),
                "max_ms": round(ms[-1], 1),
            }
    return figures


def dashboard_process(
    database: DatabaseSettings, bootstrap: str, port: int
) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "agl_stream.cli.main", "--bootstrap-servers", bootstrap,
        "--database-url", database.database_url.get_secret_value(),
        "dashboard", "--port", str(port),
    ]  # fmt: skip
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ
    )


async def wait_up(url: str, process: subprocess.Popen[bytes]) -> None:
    async with aiohttp.ClientSession() as http:
        for _ in range(600):
            if process.poll() is not None:
                said = process.stdout.read().decode() if process.stdout else ""
                raise RuntimeError(f"the dashboard stopped: {said}")
            try:
                async with http.get(f"{url}/api/overview") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError("the dashboard did not answer within 60 s")


async def main(args: argparse.Namespace) -> dict[str, Any]:
    state, kafka = await fresh_topics("bench-dashboard")
    base = load(DatabaseSettings, database_url=state.database_url)
    database = base.with_database(f"bench_dashboard_{args.rollouts}_{args.spans}")
    started = time.monotonic()
    await filled(database, args.rollouts, args.spans, args.refill)
    fill_seconds = round(time.monotonic() - started, 1)
    port = free_port()
    process = dashboard_process(database, kafka.bootstrap_servers, port)
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_up(url, process)
        pages = await measure(url, args.rollouts, args.repeats)
    finally:
        process.terminate()
        process.wait(30)
    return {
        "rollouts": args.rollouts, "spans": args.rollouts * args.spans,
        "fill_seconds": fill_seconds, "repeats": args.repeats, "pages": pages,
        "slowest_p95_ms": max(p["p95_ms"] for p in pages.values()),
    }  # fmt: skip


def report(figures: dict[str, Any]) -> None:
    table = Table(
        title=f"dashboard API on {figures['rollouts']:,} rollouts and {figures['spans']:,} spans "
        f"({figures['repeats']} calls each)",
        title_justify="left",
    )
    for column in ("call", "p50 ms", "p95 ms", "max ms"):
        table.add_column(column, justify="left" if column == "call" else "right")
    for name, p in figures["pages"].items():
        table.add_row(name, f"{p['p50_ms']:.1f}", f"{p['p95_ms']:.1f}", f"{p['max_ms']:.1f}")
    console.print(table)


if __name__ == "__main__":
    parser = benchmark_parser(__doc__)
    parser.add_argument("--rollouts", type=int, default=1_000_000)
    parser.add_argument("--spans", type=int, default=20, help="spans per rollout")
    parser.add_argument("--repeats", type=int, default=100, help="calls of each kind")
    parser.add_argument("--refill", action="store_true", help="fill the database anew")
    run_benchmark(parser, main, report)
