"""The dashboard's runs: several policies trained in one run are a curve each."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from agl_stream.dashboard.runs import runs_from_versions
from agl_stream.queries.models import Resources

START = datetime(2026, 11, 28, tzinfo=UTC)


def version(n: int, metadata: dict[str, str]) -> Resources:
    return Resources(
        resources_id=f"v{n}", version=n, resources={}, published_by="t",
        parent_resources_id=None, metadata=metadata, published_at=START + timedelta(seconds=n),
    )  # fmt: skip


def test_each_policy_of_a_run_is_a_run_of_its_own() -> None:
    versions = [
        version(1, {"run_name": "r", "step": "0", "policy": "speaker"}),
        version(2, {"run_name": "r", "step": "0", "policy": "listener"}),
        version(3, {"joint_run": "r", "joint_step": "0"}),  # what the driver pins tasks to
        version(4, {"run_name": "r", "step": "1", "policy": "listener", "mean_reward": "0.25"}),
        version(5, {"run_name": "r", "step": "1", "policy": "speaker", "mean_reward": "0.25"}),
        version(6, {"run_name": "solo", "step": "0"}),  # one policy, as before: no policy named
    ]
    runs = {run.name: run for run in runs_from_versions(versions)}
    assert set(runs) == {"r/speaker", "r/listener", "solo"}
    assert (runs["r/speaker"].policy, runs["solo"].policy) == ("speaker", "policy")
    assert [(p.step, p.reward) for p in runs["r/listener"].points] == [(0, None), (1, 0.25)]
    assert [p.resources_id for p in runs["r/speaker"].points] == ["v1", "v5"]
