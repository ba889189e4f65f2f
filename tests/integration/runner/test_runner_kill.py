"""Kill -9 one of three runner processes while rollouts are in flight: nothing is lost and
nothing is counted twice."""

from __future__ import annotations

import asyncio
import signal

import pytest

from agl_stream.events import AttemptStatus, RolloutStatus
from agl_stream.runtime.config import KafkaSettings
from tests.support.helpers import eventually
from tests.support.runs import history, queue, runner_process, wait_terminal

pytestmark = pytest.mark.slow


async def test_kill_one_of_three_runners_mid_flight(kafka: KafkaSettings) -> None:
    # Long enough that all three runners still have work in flight when one is killed.
    tasks = [{"spans": 3, "sleep": 1.5, "reward": 1.0} for _ in range(200)]
    runners = [await runner_process(kafka, f"kill-test-{i}", concurrency=8) for i in range(3)]
    try:
        ids = await queue(kafka, tasks)

        async def under_way_on_the_victim() -> bool:
            # Some rollouts done, and some the victim started and has not finished: killing
            # it then interrupts them (on a loaded machine it has been seen to hold nothing
            # just then, e.g. between a rebalance and its next batch).
            h = await history(kafka, with_spans=False)
            in_flight = [
                r for r, started in h.started.items()
                if any(s.worker_id == "kill-test-0" for s in started)
                and not any(f.worker_id == "kill-test-0" for f in h.finished.get(r, ()))
            ]  # fmt: skip
            return len(h.ended) >= 30 and bool(in_flight)

        await eventually(under_way_on_the_victim, 120, "rollouts in flight on the victim")
        runners[0].send_signal(signal.SIGKILL)
        await runners[0].wait()
        h = await wait_terminal(kafka, ids, 240)
    finally:
        for process in runners[1:]:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        for process in runners[1:]:
            await asyncio.wait_for(process.wait(), 60)
    interrupted = [
        r for r in ids if any(s.worker_id == "kill-test-0" for s in h.started[r])
        and not any(f.worker_id == "kill-test-0" for f in h.finished[r])
    ]  # fmt: skip
    for rollout_id in ids:
        final = h.final(rollout_id)
        assert final is not None and final.status == RolloutStatus.SUCCEEDED, rollout_id
        succeeded = [a for a in h.finished[rollout_id] if a.status == AttemptStatus.SUCCEEDED]
        assert len(succeeded) == 1, (rollout_id, h.finished[rollout_id])
        spans = h.spans[succeeded[0].attempt_id]
        assert sorted(s.sequence for s in spans) == list(range(succeeded[0].span_count))
        assert final.attempt_id == succeeded[0].attempt_id
    assert runners[1].returncode == 0 and runners[2].returncode == 0
    # The kill interrupted attempts; those were run again by the survivors.
    assert interrupted, "the killed runner had nothing in flight; the test proved nothing"
