"""How a worker's counts are named as Prometheus metrics (pure)."""

from __future__ import annotations

from agl_stream.telemetry.metrics import WorkerMetrics, families
from tests.support.scrape import parse


def test_counts_become_labelled_counters_gauges_and_counters() -> None:
    named = {
        f.name: (f.type, [(s.labels, s.value) for s in f.samples])
        for f in families(
            "runner",
            {
                "rollouts_succeeded": 3,
                "rollouts_failed": 1,
                "attempts_timeout": 2,
                "in_flight": 5,
                "rejoins": 7,
            },
        )
    }
    assert named["agl_stream_rollouts"] == (
        "counter", [({"status": "failed"}, 1), ({"status": "succeeded"}, 3)]
    )  # fmt: skip
    assert named["agl_stream_attempts"] == ("counter", [({"status": "timeout"}, 2)])
    assert named["agl_stream_runner_in_flight"] == ("gauge", [({}, 5)])
    assert named["agl_stream_runner_rejoins"] == ("counter", [({}, 7)])
    # Only a runner's and APO's rollouts_ and attempts_ are by status; other roles keep the name.
    [other] = families("trainer", {"attempts_dropped": 1})
    assert other.name == "agl_stream_trainer_attempts_dropped"
    counts = {"rollouts_succeeded": 3, "round": 2, "rounds": 1}
    apo = {
        f.name: (f.type, [(s.labels, s.value) for s in f.samples]) for f in families("apo", counts)
    }
    assert apo == {
        "agl_stream_apo_rollouts": ("counter", [({"status": "succeeded"}, 3)]),
        "agl_stream_apo_round": ("gauge", [({}, 2)]),
        "agl_stream_apo_rounds": ("counter", [({}, 1)]),
    }


def test_the_exposition_reads_counts_when_scraped_and_holds_histograms() -> None:
    counts = {"steps": 1}
    metrics = WorkerMetrics("trainer", lambda: counts, lambda: {("spans", 0): 4})
    metrics.observe("step", 0.3, "A step.")
    metrics.set("mean_reward", 0.5, "The reward.")
    counts["steps"] = 2  # read when scraped, not when registered
    samples = parse(metrics.render().decode())
    assert samples[("agl_stream_trainer_steps_total", ())] == 2
    assert samples[("agl_stream_trainer_step_seconds_count", ())] == 1
    assert samples[("agl_stream_trainer_step_seconds_bucket", (("le", "0.5"),))] == 1
    assert samples[("agl_stream_trainer_mean_reward", ())] == 0.5
    key = ("agl_stream_trainer_partition_lag", (("partition", "0"), ("topic", "spans")))
    assert samples[key] == 4
