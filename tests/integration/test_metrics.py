"""Every worker's /metrics, scraped over HTTP from `agl-stream worker` processes while they
work: the values move with what the workers do."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp

from agl_stream.config import DatabaseSettings, KafkaSettings, child_environment
from agl_stream.embedded.process import free_port
from agl_stream.events import RolloutMode
from tests.integration.helpers import eventually
from tests.integration.runs import queue, wait_terminal
from tests.scrape import Samples, value
from tests.scrape import scrape as scrape_url


async def scrape(port: int) -> Samples:
    return await scrape_url(f"http://127.0.0.1:{port}/metrics")


@asynccontextmanager
async def worker(
    kafka: KafkaSettings, database: DatabaseSettings, log: Path, *args: str
) -> AsyncIterator[int]:
    """`agl-stream worker ARGS --metrics-port P` as a process; yields P once it answers."""
    port = free_port()
    with log.open("ab") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agl_stream.cli.main", "worker", *args, "--heartbeat", "1",
            "--metrics-port", str(port), env=child_environment(kafka, database),
            stdout=out, stderr=out,
        )  # fmt: skip
    try:

        async def answers() -> bool:
            assert process.returncode is None, f"it stopped; see {log}"
            try:
                await scrape(port)
            except aiohttp.ClientConnectionError:
                return False
            return True

        await eventually(answers, 60, f"{args[1]}'s metrics endpoint")
        yield port
    finally:
        if process.returncode is None:
            process.terminate()
        await asyncio.wait_for(process.wait(), 60)


async def test_each_worker_serves_metrics_that_move(
    kafka: KafkaSettings, database: DatabaseSettings, tmp_path: Path
) -> None:
    log = tmp_path / "workers.log"
    async with (
        worker(kafka, database, log, "--role", "runner", "--agent", "tests.agents:behave",
               "--concurrency", "8") as runner,
        worker(kafka, database, log, "--role", "projector") as projector,
        worker(kafka, database, log, "--role", "trainer", "--checkpoint-dir",
               str(tmp_path / "checkpoints"), "--group-size", "2", "--groups-per-step", "1",
               "--max-waiting", "4") as trainer,
    ):  # fmt: skip
        before = {name: await scrape(port) for name, port in
                  (("runner", runner), ("projector", projector), ("trainer", trainer))}  # fmt: skip
        ids = await queue(kafka, [{"spans": 2}] * 4, mode=RolloutMode.TRAIN,
                          metadata={"group": "g"})  # fmt: skip
        ids += await queue(kafka, [{"spans": 1, "fail_on_attempts": [1]}], max_attempts=1)
        await wait_terminal(kafka, ids, 60)

        async def moved() -> bool:
            r, p, t = await scrape(runner), await scrape(projector), await scrape(trainer)
            return (
                value(r, "agl_stream_rollouts_total", status="succeeded") == 4
                and value(r, "agl_stream_rollouts_total", status="failed") == 1
                and value(p, "agl_stream_projector_spans_total") >= 9
                and value(t, "agl_stream_trainer_steps_total") == 2  # counted once published
            )

        await eventually(moved, 60, "every worker's metrics to count what happened")
        r, p, t = await scrape(runner), await scrape(projector), await scrape(trainer)

    assert before["runner"].get(("agl_stream_rollouts_total", (("status", "succeeded"),))) is None
    assert value(r, "agl_stream_attempts_total", status="failed") == 1
    assert value(r, "agl_stream_runner_attempt_seconds_count") == 5
    assert value(r, "agl_stream_runner_in_flight") == 0
    lags = [k for k in r if k[0] == "agl_stream_runner_partition_lag"]
    assert lags and all(r[k] == 0 for k in lags)  # every record done
    assert value(p, "agl_stream_projector_batch_seconds_count") > value(
        before["projector"], "agl_stream_projector_batch_seconds_count"
    )
    assert value(p, "agl_stream_projector_lag") == 0
    assert value(before["trainer"], "agl_stream_trainer_step") == 0
    assert value(t, "agl_stream_trainer_step") == 2
    assert value(t, "agl_stream_trainer_step_seconds_count") == 2
    assert value(t, "agl_stream_trainer_records_total") > 0


async def test_a_taken_metrics_port_stops_the_worker_with_the_setting_named(
    kafka: KafkaSettings, database: DatabaseSettings
) -> None:
    port = free_port()
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", port)
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agl_stream.cli.main", "worker", "--role", "projector",
            "--metrics-port", str(port), env=child_environment(kafka, database),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        output, _ = await asyncio.wait_for(process.communicate(), 60)
    finally:
        server.close()
    assert process.returncode != 0
    assert f"--metrics-port {port}: cannot listen on 127.0.0.1:{port}" in output.decode()
