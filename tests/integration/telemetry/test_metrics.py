"""Every worker's /metrics, scraped over HTTP from `agl-stream worker` processes while they
work: the values move with what the workers do. The same processes export their units of
work as spans, and the same metrics, by OTLP to a receiver in the test
(tests/support/otlp_receiver.py); one whose collector never answers keeps working."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiokafka import TopicPartition

from agl_stream.bus.streams import Topics, read_partitions
from agl_stream.embedded.process import free_port
from agl_stream.events import LLM, RolloutMode, SpanRecorded
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings, child_environment
from agl_stream.training.apo.optimizer import read_state
from agl_stream.training.apo.prompts import CRITIQUE_SYSTEM
from tests.support import apo_world
from tests.support.helpers import eventually
from tests.support.otlp_receiver import Receiver, black_hole, otlp_receiver
from tests.support.projection import projector_in_process
from tests.support.runs import publish_resources, queue, runner_in_process, wait_terminal
from tests.support.scrape import Samples, value
from tests.support.scrape import scrape as scrape_url

# Exported often, so that the test waits on arrivals, not on the default minute.
FAST_EXPORT = {"OTEL_METRIC_EXPORT_INTERVAL": "300", "OTEL_BSP_SCHEDULE_DELAY": "100"}


async def scrape(port: int) -> Samples:
    return await scrape_url(f"http://127.0.0.1:{port}/metrics")


def otlp_environment(receiver: Receiver) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, **FAST_EXPORT,
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=ci",
        "OTEL_EXPORTER_OTLP_HEADERS": "x-tenant=agl",
    }  # fmt: skip


@asynccontextmanager
async def worker(
    kafka: KafkaSettings,
    database: DatabaseSettings,
    log: Path,
    *args: str,
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[int]:
    """`agl-stream worker ARGS --metrics-port P` as a process (with `env` added to its
    environment); yields P once it answers, and stops it with SIGTERM (it must exit 0)."""
    port = free_port()
    with log.open("ab") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agl_stream.cli.main", "worker", *args, "--heartbeat", "1",
            "--metrics-port", str(port), env={**child_environment(kafka, database), **(env or {})},
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
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 60) == 0, f"see {log}"
    finally:
        if process.returncode is None:
            process.terminate()
        await asyncio.wait_for(process.wait(), 60)


@asynccontextmanager
async def policy_server(
    kafka: KafkaSettings, log: Path, env: Mapping[str, str]
) -> AsyncIterator[None]:
    """`agl-stream serve` following the resources topic, as a process."""
    with log.open("ab") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agl_stream.cli.main", "serve", "--port", str(free_port()),
            env={**child_environment(kafka), **env}, stdout=out, stderr=out,
        )  # fmt: skip
    try:
        yield
    finally:
        process.terminate()
        await asyncio.wait_for(process.wait(), 60)


async def test_each_worker_serves_metrics_that_move_and_exports_them_by_otlp(
    kafka: KafkaSettings, database: DatabaseSettings, tmp_path: Path
) -> None:
    log = tmp_path / "workers.log"
    async with otlp_receiver() as receiver:
        otlp = otlp_environment(receiver)
        async with (
            worker(kafka, database, log, "--role", "runner", "--agent",
                   "tests.support.agents:behave", "--concurrency", "8", env=otlp) as runner,
            worker(kafka, database, log, "--role", "projector",
                   env={**otlp, "OTEL_SERVICE_NAME": "my-projector"}) as projector,
            worker(kafka, database, log, "--role", "trainer", "--checkpoint-dir",
                   str(tmp_path / "checkpoints"), "--group-size", "2", "--groups-per-step", "1",
                   "--max-waiting", "4", env=otlp) as trainer,
            policy_server(kafka, log, otlp),
        ):  # fmt: skip
            ports = {"runner": runner, "projector": projector, "trainer": trainer}
            before = {name: await scrape(port) for name, port in ports.items()}
            ids = await queue(kafka, [{"spans": 2}] * 4, mode=RolloutMode.TRAIN,
                              metadata={"group": "g"})  # fmt: skip
            ids += await queue(kafka, [{"spans": 1, "fail_on_attempts": [1]}], max_attempts=1)
            await wait_terminal(kafka, ids, 60)

            seen: list[Samples] = []

            async def moved() -> bool:
                seen[:] = [await scrape(runner), await scrape(projector), await scrape(trainer)]
                r, p, t = seen
                return (
                    value(r, "agl_stream_rollouts_total", status="succeeded") == 4
                    and value(r, "agl_stream_rollouts_total", status="failed") == 1
                    and value(p, "agl_stream_projector_spans_total") >= 9
                    # Heartbeats land every second: read at a moment it has caught up (a page
                    # read after this one could find the latest heartbeat not projected yet).
                    and value(p, "agl_stream_projector_lag") == 0
                    and value(t, "agl_stream_trainer_steps_total") == 2  # counted once published
                )

            await eventually(moved, 60, "every worker's metrics to count what happened")
            r, p, t = seen
            await receiver.wait(lambda: exported(receiver, r, p, t))

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
    await check_otlp(kafka, receiver, ids)


def exported(receiver: Receiver, r: Samples, p: Samples, t: Samples) -> bool:
    """The receiver holds every unit of work the workers did and metrics that say so, with
    the values the Prometheus pages showed."""
    runner, trainer = "agl-stream-runner", "agl-stream-trainer"
    steps = {s.attributes["agl.step"]: s for s in receiver.named("trainer.step")}
    reloaded = {s.attributes["agl.resources_id"] for s in receiver.named("policy_server.reload")}
    return (
        len(receiver.named("runner.attempt")) == 5
        and all(len(receiver.children(a)) == 4 for a in receiver.named("runner.attempt"))
        and len(steps) == 2
        and steps[2].attributes["agl.resources_id"] in reloaded  # the latest, served
        and bool(receiver.named("projector.batch", "my-projector"))
        and receiver.value(runner, "agl_stream_rollouts", status="succeeded")
        == value(r, "agl_stream_rollouts_total", status="succeeded")
        and receiver.value(runner, "agl_stream_runner_attempt_seconds")
        == value(r, "agl_stream_runner_attempt_seconds_count")
        and receiver.value("my-projector", "agl_stream_projector_spans")
        >= value(p, "agl_stream_projector_spans_total")
        and receiver.value(trainer, "agl_stream_trainer_steps")
        == value(t, "agl_stream_trainer_steps_total")
        and receiver.value("agl-stream-policy-server", "agl_stream_policy_server_version") > 0
    )


async def check_otlp(kafka: KafkaSettings, receiver: Receiver, ids: list[str]) -> None:
    attempts = receiver.named("runner.attempt")
    span_counts: dict[str, int] = {}
    assert sorted(a.attributes["agl.rollout_id"] for a in attempts) == sorted(ids)
    assert sorted(a.attributes["agl.rollout.status"] for a in attempts) == [
        "failed", *["succeeded"] * 4,
    ]  # fmt: skip
    for attempt in attempts:
        assert attempt.parent_span_id == b""
        assert attempt.resource["deployment.environment"] == "ci"  # OTEL_RESOURCE_ATTRIBUTES
        assert attempt.resource["service.instance.id"].startswith("runner-")
        phases = {c.name: c for c in receiver.children(attempt)}
        assert sorted(phases) == ["runner.agent", "runner.claim", "runner.end", "runner.start"]
        assert all(c.trace_id == attempt.trace_id for c in phases.values())
        span_counts[attempt.attributes["agl.rollout_id"]] = phases["runner.agent"].attributes[
            "agl.span_count"
        ]
    steps = receiver.named("trainer.step")
    assert sorted(s.attributes["agl.step"] for s in steps) == [1, 2]
    for step in steps:
        assert sorted(c.name for c in receiver.children(step)) == [
            "trainer.build", "trainer.checkpoint", "trainer.commit", "trainer.publish",
            "trainer.update",
        ]  # fmt: skip
    published = {"grpo-v0"} | {s.attributes["agl.resources_id"] for s in steps}  # v0: at start
    reloads = receiver.named("policy_server.reload", "agl-stream-policy-server")
    assert {s.attributes["agl.resources_id"] for s in reloads} <= published
    assert all(s.status_code != 2 for s in reloads)  # loaded, not refused
    batches = receiver.named("projector.batch", "my-projector")  # OTEL_SERVICE_NAME
    assert sum(int(b.attributes.get("agl.spans", 0)) for b in batches) >= 9
    assert all(h.get("x-tenant") == "agl" for h in receiver.headers)  # OTEL_EXPORTER_OTLP_HEADERS
    # The agents' own spans are data on the spans topic, in traces of their own: no worker
    # span is their parent, and none was exported.
    topics = Topics(kafka)
    tps = [TopicPartition(topics.name("spans"), i) for i in range(topics.specs["spans"].partitions)]
    agents = [e for e in await read_partitions(kafka, tps) if isinstance(e, SpanRecorded)]
    assert span_counts == Counter(e.rollout_id for e in agents)
    worker_traces = {s.trace_id.hex() for s in receiver.spans}
    assert not worker_traces & {e.trace_id for e in agents}
    assert all(e.parent_span_id is None for e in agents if e.name == "agl.attempt")
    assert not {s.name for s in receiver.spans} & {e.name for e in agents}


async def test_a_runner_whose_collector_never_answers_keeps_working(
    kafka: KafkaSettings, database: DatabaseSettings, tmp_path: Path
) -> None:
    log = tmp_path / "runner.log"
    async with black_hole() as url:
        otlp = {"OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_BSP_MAX_QUEUE_SIZE": "16",
                "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "8", **FAST_EXPORT}  # fmt: skip
        args = ("--role", "runner", "--agent", "tests.support.agents:behave", "--concurrency", "8")
        async with worker(kafka, database, log, *args, env=otlp) as runner:
            ids = await queue(kafka, [{"spans": 1}] * 20)
            await wait_terminal(kafka, ids, 60)
            samples = await scrape(runner)
        # It stopped on SIGTERM with exit status 0 (worker() checks), its exports still stuck.
    assert value(samples, "agl_stream_rollouts_total", status="succeeded") == 20
    # 20 attempts of 5 spans: at most 16 queued and 8 in flight; the rest dropped, counted.
    dropped = value(samples, "agl_stream_runner_otlp_dropped_total", signal="traces",
                    reason="queue_full")  # fmt: skip
    assert dropped >= 20 * 5 - 16 - 8
    assert value(samples, "agl_stream_runner_otlp_exported_total", signal="traces") == 0
    assert "OTLP traces export:" in log.read_text()  # the reason, logged


@asynccontextmanager
async def optimizer_endpoint(hold_critiques: asyncio.Event) -> AsyncIterator[str]:
    """tests/support/apo_world.py's optimizer LLM, holding every critique until the event is set (so
    the test scrapes APO between its rounds 0 and 1)."""

    @web.middleware
    async def hold(request: web.Request, handler: Any) -> web.StreamResponse:
        body = await request.json()  # kept: the handler reads it again
        if body["messages"][0]["content"] == CRITIQUE_SYSTEM:
            await hold_critiques.wait()
        return await handler(request)

    app = apo_world.app()
    app.middlewares.append(hold)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        await runner.cleanup()


async def test_apo_serves_its_metrics_and_exports_its_rounds(
    kafka: KafkaSettings, database: DatabaseSettings, tmp_path: Path
) -> None:
    """A real APO run (`worker trainer --algorithm apo`, as test_apo runs it) with a
    runner and a projector: scraped between its rounds, and its rounds as OTLP spans."""
    log = tmp_path / "apo.log"
    for name, seed, count in (("train", 1, 12), ("val", 2, 10)):
        lines = [json.dumps(t) + "\n" for t in apo_world.tasks(count, seed=seed)]
        (tmp_path / f"{name}.jsonl").write_text("".join(lines))
    critiques = asyncio.Event()
    async with (
        otlp_receiver() as receiver,
        optimizer_endpoint(critiques) as endpoint,
        projector_in_process(kafka, database),
        runner_in_process(kafka, "tests.support.apo_world:follow_rules", concurrency=16,
                          pin_wait_seconds=60),
    ):  # fmt: skip
        await publish_resources(kafka, "setup-v0", llm=LLM(endpoint=endpoint, model="rules"))
        args = (
            "--role", "trainer", "--algorithm", "apo", "--checkpoint-dir", str(tmp_path / "apo"),
            "--train-tasks", str(tmp_path / "train.jsonl"), "--val-tasks",
            str(tmp_path / "val.jsonl"), "--optimizer-endpoint", endpoint,
            "--optimizer-model", "rules", "--prompt", apo_world.SEED_TEMPLATE, "--rounds", "1",
            "--branch", "2", "--train-batch", "4",
        )  # fmt: skip
        port = free_port()
        with log.open("ab") as out:
            apo = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "agl_stream.cli.main", "worker", *args, "--metrics-port",
                str(port), env={**child_environment(kafka, database), **otlp_environment(receiver)},
                stdout=out, stderr=out,
            )  # fmt: skip

        async def critique_asked() -> bool:  # round 0 measured, round 1's batch run, held
            assert apo.returncode is None, log.read_text()[-3000:]
            try:
                samples = await scrape(port)
            except aiohttp.ClientConnectionError:
                return False
            return value(samples, "agl_stream_apo_batch_seconds_count") == 2

        await eventually(critique_asked, 120, "APO to measure the seed and ask a critique")
        between = await scrape(port)
        critiques.set()
        # It ends by itself after its last round; its last export holds the final values.
        assert await asyncio.wait_for(apo.wait(), 120) == 0, log.read_text()[-3000:]

    assert value(between, "agl_stream_apo_rounds_total") == 1
    assert value(between, "agl_stream_apo_round") == 1
    assert value(between, "agl_stream_apo_candidates_evaluated_total") == 1
    assert value(between, "agl_stream_apo_rollouts_total", status="succeeded") == 10 + 4
    assert value(between, "agl_stream_apo_queued_total") == 10 + 4
    assert value(between, "agl_stream_apo_best_score") == 0.0  # the seed asks nothing wanted
    assert value(between, "agl_stream_apo_round_seconds_count") == 1
    assert value(between, "agl_stream_apo_optimizer_call_seconds_count") == 0  # held
    state = read_state(str(tmp_path / "apo"))
    assert state is not None
    best = state.best()
    assert best is not None
    assert best.score is not None
    assert best.score > 0
    # The last export, after the run: the values at its end.
    final = {p.metric: p.value for p in receiver.points if p.service == "agl-stream-apo"}
    assert final["agl_stream_apo_rounds"] == 2
    assert final["agl_stream_apo_best_score"] == pytest.approx(best.score)
    assert final["agl_stream_apo_candidates_evaluated"] == 3  # the seed and two rewrites
    assert receiver.value(
        "agl-stream-apo", "agl_stream_apo_rollouts", status="succeeded"
    ) == 10 + 4 + 2 * 10  # fmt: skip
    assert final["agl_stream_apo_optimizer_call_seconds"] == 1 + 2  # critique, rewrites
    rounds = sorted(receiver.named("apo.round"), key=lambda s: s.attributes["agl.apo.round"])
    assert [r.attributes["agl.apo.round"] for r in rounds] == [0, 1]
    assert rounds[1].attributes["agl.apo.best"] == best.cid
    assert rounds[1].attributes["agl.apo.best_score"] == pytest.approx(best.score)
    batches = [c.attributes["agl.apo.batch"] for c in receiver.children(rounds[1])
               if c.name == "apo.batch"]  # fmt: skip
    assert sorted(batches) == ["c1-val", "c2-val", "r1-c0-train"]
    calls = [c.attributes["agl.apo.call"] for c in receiver.children(rounds[1])
             if c.name == "apo.optimizer_call"]  # fmt: skip
    assert sorted(calls) == ["critique", "rewrite", "rewrite"]
    [seed] = [c for c in receiver.children(rounds[0]) if c.name == "apo.batch"]
    assert seed.attributes["agl.apo.rollouts.succeeded"] == 10


async def test_a_taken_metrics_port_stops_the_worker_with_the_setting_named(
    kafka: KafkaSettings, database: DatabaseSettings
) -> None:
    port = free_port()
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", port)
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agl_stream.cli.main", "worker", "projector",
            "--metrics-port", str(port), env=child_environment(kafka, database),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        output, _ = await asyncio.wait_for(process.communicate(), 60)
    finally:
        server.close()
    assert process.returncode != 0
    assert f"--metrics-port {port}: cannot listen on 127.0.0.1:{port}" in output.decode()


async def test_with_a_token_a_workers_metrics_need_it_and_its_health_does_not(
    kafka: KafkaSettings, database: DatabaseSettings, tmp_path: Path
) -> None:
    port, token = free_port(), "metrics-token-0123456789"
    env = {**child_environment(kafka, database), "AGL_STREAM_API_TOKEN": token}
    with (tmp_path / "projector.log").open("ab") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agl_stream.cli.main", "worker", "projector",
            "--metrics-port", str(port), env=env, stdout=out, stderr=out,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:

            async def healthy() -> bool:
                assert process.returncode is None, "the projector stopped"
                try:
                    async with session.get(f"{base}/health") as response:
                        return response.status == 200
                except aiohttp.ClientConnectionError:
                    return False

            await eventually(healthy, 60, "the projector's /health")
            async with session.get(f"{base}/metrics") as response:
                assert response.status == 401
            bearer = {"Authorization": f"Bearer {token}"}
            async with session.get(f"{base}/metrics", headers=bearer) as response:
                assert response.status == 200
                assert "agl_stream_projector_lag" in await response.text()
    finally:
        process.terminate()
        await asyncio.wait_for(process.wait(), 60)
