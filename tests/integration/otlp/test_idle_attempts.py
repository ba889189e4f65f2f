"""Ingested attempts end after the idle timeout (`agl-stream ingest otlp --idle-timeout`), on
the real broker: each once, with its distinct spans counted and its reward, even when the
ingester is killed (-9) between two waves of endings and started again; the trainer's
assembler then takes the train-mode ones as trajectories."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from contextlib import AbstractAsyncContextManager

import aiohttp

from agl_stream.embedded.process import free_port
from agl_stream.events import AttemptStatus, RolloutStatus
from agl_stream.events.reward_rules import AGL_REWARD
from agl_stream.runtime.config import KafkaSettings
from agl_stream.training.trajectories import Assembler
from tests.support.helpers import cli_process, eventually, invoke_cli
from tests.support.otlp_payloads import request, span
from tests.support.runs import History, history

IDLE = 3.0
WAVE = 8  # traces a wave
TRACE = 0x5AF92F3577B34DA6A3CE929D0E0E0000
PROTOBUF = {"Content-Type": "application/x-protobuf"}


def trace_payload(n: int, spans: range, reward: float | None = None) -> bytes:
    """Trace n: train mode (its own rollout), the given span ids, a reward span if asked."""
    own = [span(TRACE + n, s, f"step-{s}", parent=1 if s > 1 else None) for s in spans]
    if reward is not None:
        own.append(span(TRACE + n, 100, AGL_REWARD, parent=1, **{AGL_REWARD: reward}))
    resource = {"agl.rollout.id": f"order-{n}", "agl.rollout.mode": "train"}
    return request(own, resource=resource).SerializeToString()


def ingester(
    kafka: KafkaSettings, port: int
) -> AbstractAsyncContextManager[asyncio.subprocess.Process]:
    return cli_process(kafka, "ingest", "otlp", "--port", str(port), "--idle-timeout", str(IDLE))


async def post(http: aiohttp.ClientSession, url: str, body: bytes) -> None:
    async def taken() -> bool:
        try:
            async with http.post(url, data=body, headers=PROTOBUF) as answer:
                assert answer.status == 200, await answer.text()
                return True
        except aiohttp.ClientConnectionError:  # not listening yet
            return False

    await eventually(taken, 60, "the receiver to take a payload")


def ended(h: History) -> Counter[str]:
    return Counter(rollout for rollout, finished in h.finished.items() for _ in finished)


async def test_quiet_attempts_end_once_across_a_kill_and_the_trainer_takes_them(
    kafka: KafkaSettings,
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/traces"
    first, second = range(WAVE), range(WAVE, 2 * WAVE)
    async with aiohttp.ClientSession() as http:
        async with ingester(kafka, port) as process:
            for n in first:
                await post(http, url, trace_payload(n, range(1, 4), reward=n / 10))
            # Trace 0 goes on: its attempt ends IDLE after these, with all its spans.
            await post(http, url, trace_payload(0, range(3, 6)))
            await asyncio.sleep(IDLE / 2)
            for n in second:
                await post(http, url, trace_payload(n, range(1, 3), reward=n / 10))

            async def first_wave_ended() -> bool:
                return len(ended(await history(kafka, with_spans=False))) >= WAVE - 1

            await eventually(first_wave_ended, 60, "the first wave to end")
            process.send_signal(signal.SIGKILL)  # between the waves' endings
            await process.wait()
        async with ingester(kafka, port):
            wanted = {f"order-{n}" for n in (*first, *second)}

            async def all_ended() -> bool:
                return set(ended(await history(kafka, with_spans=False))) >= wanted

            await eventually(all_ended, 90, "every attempt to end")
            await asyncio.sleep(IDLE + 2)  # what would end twice has had the time to
            h = await history(kafka)

    assert ended(h) == Counter(dict.fromkeys(wanted, 1))
    assert Counter(r for r, events in h.ended.items() for _ in events) == ended(h)
    for n in (*first, *second):
        (finished,) = h.finished[f"order-{n}"]
        (rollout_end,) = h.ended[f"order-{n}"]
        assert finished.status is AttemptStatus.SUCCEEDED and finished.reward == n / 10
        assert finished.span_count == len({s.sequence for s in h.spans[finished.attempt_id]})
        assert finished.span_count == (6 if n == 0 else 4 if n in first else 3)
        assert rollout_end.status is RolloutStatus.SUCCEEDED
        assert rollout_end.attempt_id == finished.attempt_id

    # The trainer's assembler takes them: whole trajectories with their rewards.
    assembler = Assembler()
    offsets: Counter[tuple[str, int]] = Counter()
    read = (("rollouts", h.started), ("spans", h.spans), ("rollouts", h.finished))
    for topic, events in (*read, ("rollouts", h.ended)):
        for event in (e for group in events.values() for e in group):
            assembler.add((topic, 0), offsets[(topic, 0)], event)
            offsets[(topic, 0)] += 1
    taken = {t.rollout_id: t for t in assembler.complete()}
    assert set(taken) == wanted
    assert all(t.reward == int(t.rollout_id.split("-")[1]) / 10 for t in taken.values())


async def test_a_negative_idle_timeout_is_refused() -> None:
    refused = await invoke_cli("ingest", "otlp", "--idle-timeout", "-1")
    assert refused.exit_code == 2 and "--idle-timeout" in refused.output
