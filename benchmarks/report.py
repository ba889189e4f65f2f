"""Regenerate benchmarks/README.md: every benchmark, each in a process of its own, one after
the other on the embedded stack, with the exact command and the machine it ran on.

    .venv/bin/python -m benchmarks.report            # the sizes the README states (~20 min)
    .venv/bin/python -m benchmarks.report --quick    # small sizes, to check it works (~5 min)

(`make bench` runs the first.) Timings on a shared 2-core machine move from run to run by
tens of percent: compare figures measured in the same run, never across reports.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console

console = Console()
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "README.md"


@dataclass(frozen=True)
class Bench:
    module: str
    title: str
    args: list[str]
    quick: list[str]


BENCHES = [
    Bench("runners", "Runner throughput",
          ["--runners", "4", "--rollouts", "10000", "--max-rounds", "5"],
          ["--runners", "2", "--rollouts", "1000", "--max-rounds", "5"]),
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
]  # fmt: skip


def machine() -> dict[str, str]:
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
    return {
        "CPU": f"{cpu}, {os.cpu_count()} cores",
        "memory": f"{mem_kb / 1024 / 1024:.1f} GiB",
        "OS": platform.platform(),
        "Python": platform.python_version(),
        "commit": commit + (" (with uncommitted changes)" if dirty else ""),
    }


def run(bench: Bench, quick: bool) -> tuple[str, dict[str, Any], float]:
    args = bench.quick if quick else bench.args
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        command = [sys.executable, "-m", f"benchmarks.{bench.module}", *args]
        shown = " ".join([".venv/bin/python", "-m", f"benchmarks.{bench.module}", *args])
        began = time.monotonic()
        done = subprocess.run(
            [*command, "--json-out", str(out)], cwd=ROOT, capture_output=True, text=True
        )
        if done.returncode != 0 or not out.exists():
            raise SystemExit(
                f"benchmark {bench.module} failed (exit {done.returncode}):\n"
                + (done.stderr or done.stdout)[-3000:]
            )
        return shown, json.loads(out.read_text()), time.monotonic() - began


def table(rows: list[tuple[str, Any]]) -> str:
    lines = ["| figure | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)


def runners_section(f: dict[str, Any]) -> str:
    procs = ["| process | CPU s | peak RSS MB |", "|---|---:|---:|"]
    procs += [
        f"| {name} | {v['cpu_seconds']} | {v['peak_rss_mb']} |"
        for name, v in f["processes"].items()
    ]
    rows = [
        ("rollouts/s", f["rollouts_per_s"]),
        ("spans/s", f["spans_per_s"]),
        ("rollouts", f"{f['rollouts']:,}"),
        ("runners x concurrency", f"{f['runners']} x {f['concurrency']}"),
        ("runner --linger-ms", f["linger_ms"]),
        ("enqueue-to-start p50 ms", f["enqueue_to_start_p50_ms"]),
        ("enqueue-to-start p99 ms", f["enqueue_to_start_p99_ms"]),
        ("runner RSS MB after 1,000 rollouts", f["runner_rss_mb_after_1000"]),
        ("runner RSS MB at the end", f["runner_rss_mb_at_end"]),
    ]  # fmt: skip
    return (
        table(rows)
        + "\n\n"
        + "\n".join(procs)
        + "\n\nTarget (issues 3 and 17): 400 rollouts/s and 5,000 spans/s on this machine kind "
        + "(4 runners, at most 5 rounds, no sleep)."
    )


def projector_section(f: dict[str, Any]) -> str:
    rows = [(k.replace("_", " "), v) for k, v in f.items()]
    return (
        table(rows)
        + "\n\nTarget (issue 4): projection at least half the COPY ceiling "
        + f"(projection_to_copy_ratio 0.5); measured {f['projection_to_copy_ratio']}. "
        + "The ceiling is asyncpg's COPY of the rows, its encoding of them timed with it. "
        + "binary copy is the same rows encoded beforehand in binary COPY format, outside the "
        + "timing (PostgreSQL's own rate of taking them; the projector's compiled span reader "
        + "writes that format): projection_to_binary_copy_ratio "
        + f"{f['projection_to_binary_copy_ratio']}."
    )


def pipeline_section(f: dict[str, Any]) -> str:
    lat = ["| from enqueue to | p50 ms | p99 ms | max ms |", "|---|---:|---:|---:|"]
    for key, label in (
        ("enqueue_to_start", "attempt started"),
        ("enqueue_to_finish", "rollout finished"),
        ("enqueue_to_read_model", "terminal in the read model"),
    ):
        r = f[key]
        lat.append(f"| {label} | {r['p50_ms']} | {r['p99_ms']} | {r['max_ms']} |")
    samples = f["rss_mb_samples"]
    columns = list(samples[0])
    mem = ["| " + " | ".join(columns) + " |", "|" + "---:|" * len(columns)]
    mem += ["| " + " | ".join(str(s.get(c, "")) for c in columns) + " |" for s in samples]
    growth = ", ".join(f"{k} {v}" for k, v in f["rss_growth_mb_per_1000_rollouts"].items())
    return (
        f"{f['rollouts']:,} rollouts at {f['rate_per_s']}/s for {f['seconds']} s, "
        f"{f['runners']} runners and a projector.\n\n"
        + "\n".join(lat)
        + "\n\nRSS (MB) over the run (t in seconds; rollouts finished so far):\n\n"
        + "\n".join(mem)
        + f"\n\nGrowth, MB per 1,000 rollouts (from the second sample to the last): {growth}."
    )


def takeover_section(f: dict[str, Any]) -> str:
    rows = [
        ("empty rollouts partition: records read / seconds to settle",
         f"{f['empty_records_read']} / {f['empty_takeover_s']}"),
        (f"{f['history_records']:,} old records, with the checkpoint: records read / seconds",
         f"{f['history_records_read']} / {f['history_takeover_s']}"),
        (f"{f['history_records']:,} old records, no checkpoint (from offset 0)",
         f"{f['from_zero_records_read']:,} / {f['from_zero_takeover_s']}"),
        ("history / empty (seconds)", f["history_to_empty_ratio"]),
    ]  # fmt: skip
    return table(rows)


def trainer_section(f: dict[str, Any]) -> str:
    return table([(k.replace("_", " "), v) for k, v in f.items()])


def gateway_section(f: dict[str, Any]) -> str:
    lines = [
        "| calls | direct p50/p99 ms | through the gateway p50/p99 ms | added p50/p99 ms "
        "| direct calls/s | gateway calls/s | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in ("whole", "stream"):
        r = f[mode]
        lines.append(
            f"| {mode} | {r['direct_ms_p50']:.2f} / {r['direct_ms_p99']:.2f} "
            f"| {r['gateway_ms_p50']:.2f} / {r['gateway_ms_p99']:.2f} "
            f"| {r['added_ms_p50']:.2f} / {r['added_ms_p99']:.2f} "
            f"| {r['direct_calls_per_s']:.0f} | {r['gateway_calls_per_s']:.0f} "
            f"| {r['ratio']:.2f} |"
        )
    return "\n".join(lines)


SECTIONS = {
    "runners": runners_section,
    "projector": projector_section,
    "pipeline": pipeline_section,
    "takeover": takeover_section,
    "trainer": trainer_section,
    "step_latency": trainer_section,  # key: value rows
    "gateway": gateway_section,
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--only", nargs="*", choices=[b.module for b in BENCHES])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    host = machine()
    began = datetime.now(UTC)
    parts = []
    for bench in BENCHES:
        if args.only and bench.module not in args.only:
            continue
        with console.status(f"{bench.title}: {bench.module} ..."):
            command, figures, seconds = run(bench, args.quick)
        console.print(f"[green]done[/] {bench.title} ({seconds:.0f} s)")
        parts.append(
            f"## {bench.title}\n\n```\n{command}\n```\n\n{SECTIONS[bench.module](figures)}\n"
            f"\n(ran {seconds:.0f} s)\n"
        )
    header = [
        "# Benchmark report",
        "",
        "Generated by `make bench` (`.venv/bin/python -m benchmarks.report"
        + (" --quick" if args.quick else "")
        + "`) on "
        + began.strftime("%Y-%m-%d %H:%M UTC")
        + "; every figure below comes from that one run. Each benchmark runs in a process of "
        "its own, one after the other, against the embedded stack (`make up`); what each "
        "measures is described at the top of its script.",
        "",
        "Machine:",
        "",
        *[f"- {k}: {v}" for k, v in host.items()],
        "",
        "The machine is small and shared: figures move by tens of percent between runs. "
        "Ratios measured side by side in one run (projection vs COPY, gateway vs direct) "
        "are the ones to compare.",
        "",
    ]
    args.out.write_text("\n".join(header) + "\n" + "\n".join(parts))
    console.print(f"wrote {shlex.quote(str(args.out))}")


if __name__ == "__main__":
    main()
