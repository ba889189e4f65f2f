"""The benchmarks page of the documentation (docs/benchmarks.md), rendered from the recorded
results under benchmarks/results/, one JSON file per result: its title, the exact command,
when and on what machine it ran, and its figures (or the tables and notes of a result
recorded by hand). Every dated figure of the documentation is on that page.

    .venv/bin/python -m benchmarks.report            # make bench: run every benchmark below
                                                     # (~30 min), record each, render the page
    .venv/bin/python -m benchmarks.report --only gateway     # run and record some of them
    .venv/bin/python -m benchmarks.report --render   # render the page from the results
    .venv/bin/python -m benchmarks.report --check    # exit 1 if the page is not what the
                                                     # results render (make docs runs it)
    .venv/bin/python -m benchmarks.report --quick    # small sizes, to check it works (~5 min):
                                                     # results and page in a temporary folder

A run records a result in place of the one before (its file in benchmarks/results/, named
after the benchmark's module). Results measured otherwise (a GPU, an hour-long soak, a test
run) are recorded the same way, by hand or by their own make target. Timings on a shared
2-core machine move from run to run by tens of percent: compare figures measured in the same
run, never across results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console

console = Console()
ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "benchmarks" / "results"

Result = dict[str, Any]
Figures = dict[str, Any]


@dataclass(frozen=True)
class Bench:
    module: str
    title: str
    args: list[str]
    quick: list[str]


# What `make bench` runs, in this order; each result is recorded as results/<module>.json.
BENCHES = [
    Bench("runners", "Runner throughput",
          ["--runners", "4", "--rollouts", "10000", "--max-rounds", "5"],
          ["--runners", "2", "--rollouts", "1000", "--max-rounds", "5"]),
    Bench("java_enqueue", "Queueing tasks from Java against Python",
          ["--tasks", "20000", "--rounds", "2"],
          ["--tasks", "2000", "--rounds", "1"]),
    Bench("projector", "Projection throughput against the COPY ceiling",
          ["--spans", "300000", "--projectors", "2"],
          ["--spans", "30000", "--projectors", "1", "--steady-seconds", "5"]),
    Bench("pipeline", "End-to-end latency and memory over a long run",
          ["--runners", "2", "--rate", "20", "--seconds", "300", "--sample-every", "30"],
          ["--runners", "2", "--rate", "20", "--seconds", "30", "--sample-every", "10"]),
    Bench("takeover", "Takeover of a partition against its history",
          ["--history", "1000000"],
          ["--history", "50000"]),
    Bench("trainer", "Trainer samples/s (GRPO, tiny model, CPU)",
          ["--groups", "64", "--group-size", "8", "--groups-per-step", "4"],
          ["--groups", "8", "--group-size", "4", "--groups-per-step", "2"]),
    Bench("step_latency", "One training step of the demo, phase by phase",
          ["--steps", "12"],
          ["--steps", "4"]),
    Bench("gateway", "LLM gateway overhead",
          ["--calls", "400", "--latency-calls", "200", "--concurrency", "16"],
          ["--calls", "100", "--latency-calls", "50", "--concurrency", "8"]),
    Bench("dashboard", "The dashboard's API on a big read model",
          ["--rollouts", "1000000", "--spans", "20"],
          ["--rollouts", "20000", "--spans", "20", "--repeats", "20"]),
    Bench("agl_client", "Agent Lightning's store benchmark client on both stores",
          ["--rounds", "2", "--tasks", "512", "--batch-size", "128", "--runners", "4"],
          ["--rounds", "1", "--tasks", "64", "--batch-size", "32", "--runners", "2"]),
]  # fmt: skip

# The page: its sections and the results in each, by file name (an anchor of the page each).
SECTIONS: list[tuple[str, list[str]]] = [
    ("The runners", ["runners", "java_enqueue", "takeover", "takeover_blackhole", "pipeline"]),
    ("The read model", ["projector", "projector_1m", "dashboard"]),
    ("Training", ["real_model", "real_model_reload", "demo", "step_latency", "trl_comparison",
                  "trainer", "trainer_variants", "gpu_training", "online_training",
                  "two_policies"]),
    ("Serving", ["gateway", "gateway_by_hand", "vllm_serving", "vllm_scheduler", "demo_engines",
                 "two_policies_serving"]),
    ("Operations", ["embedded_stack", "metrics_cost", "export_memory"]),
    ("Agent Lightning's store", ["agl_store", "agl_store_tests", "agl_client"]),
    ("Reliability", ["chaos", "soak", "faults"]),
    ("Tests", ["test_durations"]),
]  # fmt: skip

INTRO = """\
# Benchmarks

<!-- Generated by benchmarks/report.py from benchmarks/results/*.json: edit those, then run
     `.venv/bin/python -m benchmarks.report --render`. -->

Every measured figure of this documentation is on this page, each with the command that
produced it, when it ran and on what machine. The page is rendered by `benchmarks/report.py`
from the results recorded under `benchmarks/results/` (one JSON file each):

- `make bench` runs the benchmarks of the runners, the Java client's enqueue against
  Python's, the projection, end-to-end latency, takeover, the trainer, a demo step, the
  gateway, the dashboard and Agent Lightning's store benchmark client, one after the other,
  each in a process of its own on the embedded stack, records each result in place of the
  one before and renders this page again (`.venv/bin/python -m benchmarks.report --only
  NAME ...` runs some of them; `--quick` runs small sizes into a temporary folder).
- Other results were measured by the command shown (a GPU benchmark, the hour-long soak, a
  test run) and recorded the same way.

The machine is small and shared: figures move by tens of percent between runs. Ratios
measured side by side in one run (projection against COPY, gateway against direct) are the
ones to compare; figures from different results are not.
"""


# ---- rendering ---------------------------------------------------------------------------


def cell(value: Any) -> str:
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.1f}"
        text = f"{value:.3f}".rstrip("0")
        return text + "0" if text.endswith(".") else text
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, list):
        if value and all(isinstance(v, list) for v in value):  # pairs: "a / b; c / d"
            return "; ".join(" / ".join(cell(x) for x in v) for v in value)
        return ", ".join(cell(v) for v in value)
    return str(value).replace("|", "\\|")


def grid(columns: Sequence[str], rows: Sequence[Sequence[Any]], align: Sequence[str] = ()) -> str:
    marks = [("---:" if a == "right" else "---") for a in align] or ["---"] * len(columns)
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(marks) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def key_values(figures: Mapping[str, Any]) -> str:
    return grid(["figure", "value"], [(k.replace("_", " "), v) for k, v in figures.items()])


def runners_body(f: Figures) -> str:
    procs = [(name, v["cpu_seconds"], v["peak_rss_mb"]) for name, v in f["processes"].items()]
    rows = [
        ("rollouts/s", f["rollouts_per_s"]),
        ("spans/s", f["spans_per_s"]),
        ("rollouts", f["rollouts"]),
        ("runners x concurrency", f"{f['runners']} x {f['concurrency']}"),
        ("runner --linger-ms", f["linger_ms"]),
        ("enqueue-to-start p50 ms", f["enqueue_to_start_p50_ms"]),
        ("enqueue-to-start p99 ms", f["enqueue_to_start_p99_ms"]),
        ("runner RSS MB after 1,000 rollouts", f["runner_rss_mb_after_1000"]),
        ("runner RSS MB at the end", f["runner_rss_mb_at_end"]),
    ]
    return (
        "A synthetic agent shaped like a multi-round agent (`benchmarks/synthetic.py`: 1 to "
        "`--max-rounds` rounds, each a span with two nested children carrying 2-6 random "
        "attributes, a reward span in half of the rounds, a final span and reward); every "
        "rollout queued at once, timed from the first enqueue to the last terminal event on "
        "the broker, every span checked to be there.\n\n"
        + grid(["figure", "value"], rows)
        + "\n\n"
        + grid(["process", "CPU s", "peak RSS MB"], procs, ["left", "right", "right"])
        + "\n\nTarget: 400 rollouts/s and 5,000 spans/s on this machine kind (4 runners, at "
        "most 5 rounds, no sleep)."
    )


def projector_body(f: Figures) -> str:
    return (
        "Rollouts shaped like the runner benchmark's (about 20 spans each, ~600 bytes a span "
        "on the wire) with their lifecycle events, projected by N projector processes into a "
        "fresh database, timed from their first commit until every record is projected. In "
        "the same run, the ceiling: asyncpg's COPY of the same span rows into a table shaped "
        "like the read model's spans table, its encoding timed with it; and the same rows "
        "encoded beforehand in binary COPY format (PostgreSQL's own rate of taking them: the "
        "format the projector's compiled span reader writes). Then a steady load, its lag "
        "sampled twice a second.\n\n"
        + key_values(f)
        + "\n\nTarget: projection at least half the COPY ceiling (projection to copy ratio "
        f"0.5); measured {f['projection_to_copy_ratio']}."
    )


def pipeline_body(f: Figures) -> str:
    latency = [
        (label, f[key]["p50_ms"], f[key]["p99_ms"], f[key]["max_ms"])
        for key, label in (
            ("enqueue_to_start", "attempt started"),
            ("enqueue_to_finish", "rollout finished"),
            ("enqueue_to_read_model", "terminal in the read model"),
        )
    ]
    samples = f["rss_mb_samples"]
    columns = list(samples[0])
    memory = [[s.get(c, "") for c in columns] for s in samples]
    growth = ", ".join(f"{k} {v}" for k, v in f["rss_growth_mb_per_1000_rollouts"].items())
    return (
        f"{f['rollouts']:,} rollouts at {f['rate_per_s']}/s for {f['seconds']} s, "
        f"{f['runners']} runners and a projector.\n\n"
        + grid(
            ["from enqueue to", "p50 ms", "p99 ms", "max ms"],
            latency,
            ["left", "right", "right", "right"],
        )
        + "\n\nTarget: enqueue-to-start under 50 ms at p99 at a steady load.\n\n"
        "RSS (MB) over the run (t in seconds; rollouts finished so far):\n\n"
        + grid(columns, memory, ["right"] * len(columns))
        + f"\n\nGrowth, MB per 1,000 rollouts (from the second sample to the last): {growth}."
    )


def takeover_body(f: Figures) -> str:
    rows = [
        ("empty rollouts partition: records read / seconds to settle",
         f"{f['empty_records_read']} / {f['empty_takeover_s']}"),
        (f"{f['history_records']:,} old records, with the checkpoint: records read / seconds",
         f"{f['history_records_read']} / {f['history_takeover_s']}"),
        (f"{f['history_records']:,} old records, no checkpoint (from offset 0)",
         f"{f['from_zero_records_read']:,} / {f['from_zero_takeover_s']}"),
        ("history / empty (seconds)", f["history_to_empty_ratio"]),
    ]  # fmt: skip
    return (
        "Partition 0 of a rollouts topic filled with old records (finished rollouts); a "
        "runner works 20 rollouts of tasks partition 0 and stops; the next runner's takeover "
        "of that partition (fence, checkpoint, fold) is timed, against the same on empty "
        "topics.\n\n" + grid(["figure", "value"], rows)
    )


def takeover_blackhole_body(f: Figures) -> str:
    rows = [
        (label, f[key]["min_s"], f[key]["median_s"], f[key]["max_s"])
        for key, label in (
            ("clean", "every broker healthy"),
            ("blackholed", "one broker blackholed (fenced by the cluster)"),
            ("through_the_cut", "one broker blackholed, a runner up since before the cut"),
        )
    ]
    return (
        f"{f['brokers']} Apache Kafka nodes, each on a host of its own (a network namespace), "
        "topics replicated three times; runners in the benchmark's process bootstrap from "
        f"every broker (request timeout {f['request_timeout_ms']:,} ms). Each of "
        f"{f['rounds']} rounds: rollouts run by a resident runner, a second runner joins (the "
        "group splits the 8 tasks partitions) and leaves (the resident takes all 8 back); "
        "every partition settled (fence, checkpoint, fold) is a takeover, timed by the runner "
        f"({f['takeovers_each']} healthy, after a warm-up round). Then one broker host's "
        "link drops every packet (iptables DROP): once the cluster has fenced the broker "
        f"({f['fenced_after_s']} s), the resident runs one more round (its clients began "
        "before the cut), and fresh runners on fresh topics run as many rounds as before.\n\n"
        + grid(
            ["takeovers", "min s", "median s", "max s"],
            rows,
            ["left", "right", "right", "right"],
        )
        + f"\n\nBlackholed / healthy: {f['median_ratio']} (medians), {f['max_ratio']} "
        "(maxima); target: at most 2."
    )


def trainer_body(f: Figures) -> str:
    return (
        "Online: a trainer and a runner (the demo's agent sampling the latest checkpoint in "
        "process), from the first step to the last. Offline: `retrain` of the same offset "
        "range, the trainer alone; variants of it side by side when the run has them.\n\n"
        + key_values(f)
    )


def step_latency_body(f: Figures) -> str:
    phases = ("enqueue", "pickup", "sampling", "to trainer", "update", "publish")
    step = f["step_median_s"]
    rows = []
    for p in phases:
        median, most = f[f"{p}_median_s"], f[f"{p}_max_s"]
        rows.append((p, f"{median:.3f}", f"{most:.3f}", f"{median / step:.0%}"))
    rows.append(("**step**", f"**{step:.3f}**", "", ""))
    reached = f.get("seconds_to_reward_0.9")
    return (
        "The demo on fresh topics; each cycle (version n-1 on the topic to version n) broken "
        "into phases from the topics' timestamps and each checkpoint's `timings`: enqueue "
        "(version out to first task queued), pickup (to the first attempt started), sampling "
        "(to the last rollout ended), to trainer (to the groups full), update (samples built, "
        "GRPO update), publish (checkpoint written, hashed, version on the topic).\n\n"
        f"{f['cycles_measured']} cycles, {f['runners']} runners x concurrency "
        f"{f['concurrency']}, {f.get('engine', 'torch')} engine:\n\n"
        + grid(
            ["phase", "median s", "max s", "share of the median step"],
            rows,
            ["left", "right", "right", "right"],
        )
        + f"\n\nMean reward {f['first_tenth_reward']:.3f} (first tenth of the steps) -> "
        f"{f['last_tenth_reward']:.3f} (last tenth); 0.9 reached "
        + (f"{reached} s after the first version" if reached is not None else "never")
        + f"; {f['wall_s']} s in all."
    )


def gateway_body(f: Figures) -> str:
    rows = []
    for mode in ("whole", "stream"):
        r = f[mode]
        rows.append((
            mode,
            f"{r['direct_ms_p50']:.2f} / {r['direct_ms_p99']:.2f}",
            f"{r['gateway_ms_p50']:.2f} / {r['gateway_ms_p99']:.2f}",
            f"{r['added_ms_p50']:.2f} / {r['added_ms_p99']:.2f}",
            f"{r['direct_calls_per_s']:.0f}", f"{r['gateway_calls_per_s']:.0f}",
            f"{r['ratio']:.2f}",
        ))  # fmt: skip
    return (
        "A stub upstream answering 32 tokens at once in its own process, `agl-stream "
        "gateway` in another, recording to the embedded broker; calls direct and through the "
        "gateway, whole and streamed.\n\n"
        + grid(
            [
                "calls",
                "direct p50/p99 ms",
                "through the gateway p50/p99 ms",
                "added p50/p99 ms",
                "direct calls/s",
                "gateway calls/s",
                "ratio",
            ],
            rows,
            ["left"] + ["right"] * 6,
        )
    )


def dashboard_body(f: Figures) -> str:
    rows = [(name, p["p50_ms"], p["p95_ms"], p["max_ms"]) for name, p in f["pages"].items()]
    return (
        f"A read model of {f['rollouts']:,} rollouts and {f['spans']:,} spans written by "
        "PostgreSQL itself, 500 resources versions, 16 workers; the dashboard as its own "
        f"process; {f['repeats']} calls of each kind one after the other, with varied "
        "arguments.\n\n"
        + grid(["call", "p50 ms", "p95 ms", "max ms"], rows, ["left", "right", "right", "right"])
    )


def gpu_body(f: Figures) -> str:
    about = ", ".join(f"{k} {v}" for k, v in f["about"].items())
    named = {
        "case": "case", "parameters_m": "parameters (M)", "trainable_m": "trainable (M)",
        "step_s": "step s", "samples_per_s": "samples/s", "train_tokens_per_s": "train tokens/s",
        "peak_gib": "peak GiB", "sample_tokens_per_s": "sample tokens/s",
        "engine_tokens_per_s": "engine tokens/s",
    }  # fmt: skip
    columns = list(named.values())
    rows = [[r.get(k, "") for k in named] for r in f["results"]]
    return f"{about}.\n\n" + grid(columns, rows, ["left"] + ["right"] * (len(columns) - 1))


def real_model_body(f: Figures) -> str:
    agl, trl = f["agl_stream"], f.get("trl")
    about = ", ".join(f"{k} {v}" for k, v in f["settings"].items() if v is not None)
    theirs = {p["step"]: p for p in trl["curve"]} if trl else {}
    columns = ["step", "agl-stream held-out accuracy", "training s"]
    if trl:
        columns += ["TRL held-out accuracy", "TRL training s"]
    rows = []
    for point in agl["curve"]:
        row = [point["step"], f"{point['accuracy']:.3f}", point["training_s"]]
        if trl:
            other = theirs.get(point["step"], {})
            row += [f"{other['accuracy']:.3f}" if other else "", other.get("training_s", "")]
        rows.append(row)
    curve = grid(columns, rows, ["right"] * len(columns))
    low, high = f["final_interval_95"]
    base_low, base_high = f["base_interval_95"]
    figures: list[tuple[str, Any]] = [
        ("base accuracy (95% interval)", f"{f['base_accuracy']:.3f} [{base_low}, {base_high}]"),
        ("final accuracy (95% interval)", f"{f['final_accuracy']:.3f} [{low}, {high}]"),
        ("gain (points)", f["gain_points"]),
        ("agl-stream wall s (with vLLM's start and evaluations)", agl["wall_s"]),
        ("reload after a step, s (median / max)",
         f"{agl['reload_s']['median']} / {agl['reload_s']['max']}"),
    ]  # fmt: skip
    if trl:
        figures += [
            ("TRL wall s", trl["wall_s"]),
            ("TRL generation", trl["generation"]),
            (
                "time_ratio_vs_trl (agl-stream's training s to TRL's final accuracy / TRL's)",
                f["time_ratio_vs_trl"],
            ),
        ]
    phases = ", ".join(f"{k} {v}" for k, v in agl.get("phases_median_s", {}).items())
    return (
        f"{about}; {f['samples']} samples.\n\n"
        + curve
        + "\n\n"
        + grid(["figure", "value"], figures)
        + (f"\n\nagl-stream's step, phase by phase (median s): {phases}." if phases else "")
    )


def soak_body(f: Figures) -> str:
    wanted = ["rollouts", "minutes", "runners", "restarts", "stopped_while_starting", "lost",
              "run_twice", "longest_stall_s", "tasks_log_start", "retention_minutes",
              "max_takeover_ms"]  # fmt: skip
    rows: list[tuple[str, Any]] = [(k.replace("_", " "), f[k]) for k in wanted if k in f]
    rows.append(("unclean exits", len(f.get("unclean_exits", []))))
    drift = [(name, f"{value:+.1%}") for name, value in f.get("rss_drift", {}).items()]
    return (
        grid(["figure", "value"], rows)
        + "\n\nRSS drift after warm-up, per process life:\n\n"
        + grid(["process", "drift"], drift, ["left", "right"])
    )


AGL_CLIENT_ROUND_COLUMNS = ["round", "store", "start s", "fit wall s", "rollouts/s",
                            "store side CPU s", "client CPU s"]  # fmt: skip


def agl_client_body(f: Figures) -> str:
    w, stores = f["workload"], f["stores"]
    named = (("wall_s", "fit wall s"), ("rollouts_per_s", "rollouts/s"),
             ("store_cpu_ms_per_rollout", "store side CPU ms per rollout"),
             ("client_cpu_ms_per_rollout", "client side CPU ms per rollout"))  # fmt: skip
    rows: list[tuple[str, Any, Any]] = [
        (label, stores["agl"][key], stores["agl-stream"][key]) for key, label in named
    ]
    rows.append(("rollouts/s, agl-stream / agl", "", f["rollouts_per_s_ratio"]))
    rounds = [
        (r["round"], r["store"], r["store_start_s"], r["wall_s"], r["rollouts_per_s"],
         ", ".join(f"{role} {s}" for role, s in r["store_cpu_s"].items()), r["client_cpu_s"])
        for r in f["rounds"]
    ]  # fmt: skip
    return (
        "The workload of Agent Lightning's own store benchmark client (its "
        "`tests/benchmark/benchmark_store.py`, batch mode, v0.3.0) reproduced: Agent "
        f"Lightning's Trainer with {w['runners']} runner processes and an algorithm that "
        f"publishes an LLM resource, enqueues {w['batch_size']} tasks, polls "
        f"`wait_for_rollouts` every {w['poll_seconds']} s and checks each finished rollout's "
        f"spans, batch after batch, {w['tasks']:,} rollouts in all; the agent runs 1 to "
        f"{w['max_rounds']} rounds of a span with two nested ones (random attributes, each "
        f"sleeping up to {w['sleep_seconds']} s), rewards, a final span. On Agent "
        "Lightning 0.3.0's in-memory store behind `agl store`, and on `agl-stream store` on "
        "a private embedded stack (fresh topics and database each round), in alternate "
        f"rounds, {w['rounds']} of each; the medians. CPU over the fit, per rollout: the "
        "store side's (its server; for agl-stream also the broker and PostgreSQL) and the "
        "client's (the Trainer's process and its runners). A runner that finds the queue "
        "empty waits 5 s (Agent Lightning's default), so each batch boundary costs either "
        "store up to ~5 s.\n\n"
        + grid(["figure", "agl (in memory)", "agl-stream"], rows, ["left", "right", "right"])
        + "\n\nEach round:\n\n"
        + grid(
            AGL_CLIENT_ROUND_COLUMNS, rounds, ["right", "left"] + ["right"] * 3 + ["left", "right"]
        )
    )


JAVA_ENQUEUE_ROUND_COLUMNS = ["round", "producer", "enqueue s", "tasks/s", "process wall s",
                              "CPU s", "to last finish s"]  # fmt: skip


def java_enqueue_body(f: Figures) -> str:
    producers = ("java", "python", "python-cli")
    named = (("enqueue_s", "enqueue s"), ("tasks_per_s", "tasks/s"),
             ("process_wall_s", "process wall s (with its start)"),
             ("process_cpu_s", "producer CPU s"),
             ("to_last_finished_s", "s from its start to the runners' last finish"))  # fmt: skip
    rows = [(label, *(f["producers"][p].get(key, "") for p in producers)) for key, label in named]
    rounds = [
        (r["round"], r["producer"], r["enqueue_s"], r["tasks_per_s"], r.get("process_wall_s", ""),
         r["process_cpu_s"], r["to_last_finished_s"])
        for r in f["each_round"]
    ]  # fmt: skip
    return (
        f"{f['tasks']:,} tasks queued by each producer in turn, {f['rounds']} rounds (the "
        f"order alternating), into {f['runners']} runner processes (concurrency "
        f"{f['concurrency']}, the synthetic agent with at most {f['max_rounds']} round) that "
        "finish every rollout before the next producer starts; the medians. `java`: the Java "
        "example (`examples/java-client`, kafka-clients and Apache Avro, no agl-stream code) as "
        "a process (its launcher: `java -jar` with the quick compiler alone and the serial "
        "collector), its own figure from reading the file to every record acknowledged (the "
        "JVM's start is in the process wall time); `python`: `agl_stream.commands.enqueue."
        "enqueue()` in the benchmark's process (producer start to every record acknowledged); "
        "`python-cli`: `agl-stream enqueue FILE --again` as a process (the CLI's resumable "
        "enqueue, in transactions).\n\n"
        + grid(["figure", "java", "python", "python-cli"], rows, ["left"] + ["right"] * 3)
        + f"\n\nJava's tasks/s over Python's `enqueue()`: **{f['java_to_python_tasks_per_s']}**; "
        "the Java process's wall time over `agl-stream enqueue`'s: "
        f"{f['java_process_to_python_cli_wall']}. Target: the Java producer queues at least "
        "as fast as Python's enqueue.\n\nEach round:\n\n"
        + grid(JAVA_ENQUEUE_ROUND_COLUMNS, rounds, ["right", "left"] + ["right"] * 5)
    )


def flat_body(f: Figures) -> str:
    return key_values(f)


def records_body(f: Any) -> str:
    rows: list[dict[str, Any]] = f
    columns = list(rows[0])
    return grid(columns, [[r.get(c, "") for c in columns] for r in rows])


BODIES: dict[str, Callable[[Any], str]] = {
    "runners": runners_body,
    "projector": projector_body,
    "pipeline": pipeline_body,
    "takeover": takeover_body,
    "takeover_blackhole": takeover_blackhole_body,
    "trainer": trainer_body,
    "step_latency": step_latency_body,
    "gateway": gateway_body,
    "dashboard": dashboard_body,
    "gpu_training": gpu_body,
    "soak": soak_body,
    "real_model": real_model_body,
    "agl_client": agl_client_body,
    "java_enqueue": java_enqueue_body,
    "flat": flat_body,
    "records": records_body,
}


def figures_of(result: Result) -> Any:
    if "figures_file" in result:
        return json.loads((ROOT / result["figures_file"]).read_text())
    return result.get("figures")


def render_result(name: str, result: Result) -> str:
    parts = [f"### {result['title']} {{#{name.replace('_', '-')}}}", ""]
    parts.append(f"Measured {result['measured']} on {result['machine']}.")
    parts += ["", "```", result["command"], "```", ""]
    figures = figures_of(result)
    if result.get("bench") and figures is not None:
        parts += [BODIES[result["bench"]](figures), ""]
        if "figures_file" in result:
            parts += [f"(Figures from `{result['figures_file']}`.)", ""]
    for table in result.get("tables", []):
        parts += [grid(table["columns"], table["rows"], table.get("align", ())), ""]
    for note in result.get("notes", []):
        parts += [note, ""]
    if "seconds" in result:
        parts += [f"(ran {result['seconds']:.0f} s)", ""]
    return "\n".join(parts)


def load_results(folder: Path) -> dict[str, Result]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def render(results: Mapping[str, Result]) -> str:
    placed = [name for _, names in SECTIONS for name in names]
    unplaced = sorted(set(results) - set(placed))
    parts = [INTRO]
    for heading, names in SECTIONS + ([("Other results", unplaced)] if unplaced else []):
        present = [n for n in names if n in results]
        if present:
            parts.append(f"## {heading}\n")
            parts += [render_result(n, results[n]) for n in present]
    return "\n".join(parts).rstrip("\n") + "\n"


# ---- running -----------------------------------------------------------------------------


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "?",
    )
    mem_kb = next(
        int(line.split()[1])
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal")
    )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=ROOT, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem_kb / 1024 / 1024:.1f} GiB; "
        f"{platform.platform()}; Python {platform.python_version()}; the embedded stack; "
        f"commit {commit}" + (" (with uncommitted changes)" if dirty else "")
    )


def run(bench: Bench, quick: bool, host: str) -> Result:
    args = bench.quick if quick else bench.args
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        command = [sys.executable, "-m", f"benchmarks.{bench.module}", *args]
        shown = " ".join([".venv/bin/python", "-m", f"benchmarks.{bench.module}", *args])
        began = datetime.now(UTC)
        clock = time.monotonic()
        done = subprocess.run(
            [*command, "--json-out", str(out)], cwd=ROOT, capture_output=True, text=True
        )
        if done.returncode != 0 or not out.exists():
            raise SystemExit(
                f"benchmark {bench.module} failed (exit {done.returncode}):\n"
                + (done.stderr or done.stdout)[-3000:]
            )
        return {
            "title": bench.title,
            "bench": bench.module,
            "command": shown,
            "measured": began.strftime("%Y-%m-%d %H:%M UTC") + " (`make bench`)",
            "machine": host,
            "seconds": round(time.monotonic() - clock),
            "figures": json.loads(out.read_text()),
        }


def write(path: Path, result: Result) -> None:
    path.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--only", nargs="*", choices=[b.module for b in BENCHES])
    parser.add_argument("--render", action="store_true", help="run nothing; render the page")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    parser.add_argument("--out", type=Path, default=PAGE)
    args = parser.parse_args()
    if args.check:
        wanted = render(load_results(RESULTS))
        if not args.out.exists() or args.out.read_text() != wanted:
            raise SystemExit(
                f"{args.out.relative_to(ROOT)} is not what benchmarks/results/ renders: run "
                "`.venv/bin/python -m benchmarks.report --render` (never edit the page itself)"
            )
        return
    results_dir, out = RESULTS, args.out
    if args.quick:  # a smoke run never replaces recorded results
        scratch = Path(tempfile.mkdtemp(prefix="agl-bench-quick-"))
        results_dir, out = scratch / "results", scratch / "benchmarks.md"
        results_dir.mkdir()
    if not args.render:
        host = machine()
        for bench in BENCHES:
            if args.only and bench.module not in args.only:
                continue
            with console.status(f"{bench.title}: {bench.module} ..."):
                result = run(bench, args.quick, host)
            write(results_dir / f"{bench.module}.json", result)
            console.print(f"[green]done[/] {bench.title} ({result['seconds']} s)")
    out.write_text(render(load_results(results_dir)))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
