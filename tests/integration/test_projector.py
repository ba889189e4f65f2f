"""The projector turns what runners did into rows the query API reads."""

from __future__ import annotations

from agl_stream.config import DatabaseSettings, KafkaSettings
from agl_stream.queries import ReadModel
from tests.integration.projection import projector_in_process
from tests.integration.runs import queue, runner_in_process, wait_terminal


async def test_runs_become_rows(kafka: KafkaSettings, database: DatabaseSettings) -> None:
    tasks = [{"spans": 3, "reward": 0.5}] * 6 + [{"spans": 1, "fail_on_attempts": [1]}] * 2
    ids = await queue(kafka, tasks, max_attempts=2, retry_condition=("failed",))
    async with (
        projector_in_process(kafka, database),
        runner_in_process(kafka, concurrency=4),
        ReadModel.open(database) as rm,
    ):
        statuses = await rm.wait_for_rollouts(ids, within=60)
        assert set(statuses.values()) == {"succeeded"}
        retried = ids[-1]
        attempts = await rm.attempts(retried)
        assert [a.status for a in attempts] == ["failed", "succeeded"]
        assert all(a.complete for a in attempts)
        rollout = await rm.rollout(retried)
        assert rollout.attempt_count == 2 and rollout.latest_attempt_id == attempts[1].attempt_id
        spans = await rm.spans(ids[0], latest_attempt=True)
        assert [s.sequence for s in spans] == list(range(len(spans)))
        assert len(spans) == attempts[0].span_count or len(spans) >= 3
        page = await rm.rollouts(status=("succeeded",), limit=5)
        assert len(page.items) == 5 and page.next_cursor is not None
        rest = await rm.rollouts(status=("succeeded",), limit=5, cursor=page.next_cursor)
        assert {r.rollout_id for r in page.items + rest.items} == set(ids)
        workers = await rm.workers()
        assert {w.role for w in workers} >= {"runner", "projector"}
    h = await wait_terminal(kafka, ids, 5)
    assert all(h.final(i) is not None for i in ids)
