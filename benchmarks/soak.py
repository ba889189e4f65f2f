"""Soak: the whole pipeline for a long time on the embedded stack, with restarts, short
retention and a steady load; does memory stay flat, do takeovers stay quick, is anything
lost, run twice, or stuck?

    .venv/bin/python -m benchmarks.soak                      # make soak: 1M rollouts, 60 min
    .venv/bin/python -m benchmarks.soak --rollouts 6000 --minutes 3 --restart-every 15

Runner processes (runner-0 is never restarted: its memory is the long-lived one), a
projector and a trainer, on fresh topics whose tasks, rollouts, spans and workers topics
keep --retention-minutes (segments close every minute, so old ones are deleted while it
runs) and a fresh read model. Tasks are queued at the rate that spreads --rollouts over
--minutes; one in --train-every is a train-mode rollout that samples the trainer's latest
checkpoint (the trainer trains on those), the rest are quick eval-mode ones. Every
--restart-every seconds another runner is restarted (SIGTERM, then SIGKILL next time: a
rebalance either way); the projector and the trainer are killed and restarted every
--others-every seconds. Every --sample-every seconds: each process's RSS, the consumer
lag of each group, the slowest takeover the runners report, rollouts terminal so far.

At the end, through the read model: rollouts not terminal (lost), rollouts with two
succeeded attempts (run twice), the longest time without progress while work was queued
(a hang), and per process the RSS drift after warm-up (the median of the last tenth of its
samples against the median of the samples from the end of its warm-up to a third of its life;
warm-up ends a quarter into the life, or later if RSS has not yet come within 3% of the
median of the life's second half: a slow start is not counted as growth, a leak still is).

    .venv/bin/python -m benchmarks.soak --from-json benchmarks/soak.json

prints a saved run's figures again, its drifts measured again from its samples (each
process's life cut where its RSS falls by more than a tenth: a restart).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
from aiokafka import TopicPartition
from rich.console import Console
from rich.table import Table

from agl_stream.agent import Rollout, emit_message, rollout
from agl_stream.bus.kafka import admin_client, end_offsets, producer, retrying
from agl_stream.bus.streams import EventPublisher, Topics
from agl_stream.commands.enqueue import RolloutOptions, make_rollout
from agl_stream.db.migrate import migrate
from agl_stream.demo.task import ANSWER_WORDS, score
from agl_stream.events import Checkpoint, RolloutMode
from agl_stream.projection.projector import projector_group
from agl_stream.runner.worker import runner_group
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings, child_environment, load
from agl_stream.training.trainer import trainer_group
from benchmarks.runners import sample
from benchmarks.stack import benchmark_parser, fresh_topics, run_benchmark

console = Console()
SHORT_LIVED = ("tasks", "rollouts", "spans", "workers")
TERMINAL = ("succeeded", "failed", "cancelled")


@rollout
def soak_agent(task: dict[str, Any], rollout: Rollout, policy: Checkpoint | None = None) -> float:
    """Quick for eval rollouts; train rollouts sample the latest checkpoint, as the demo."""
    emit_message(f"soak {task.get('n', task['letter'])}", attempt=rollout.attempt_number)
    if rollout.mode != RolloutMode.TRAIN or policy is None:
        return 1.0
    from agl_stream.training.local_llm import local_llm
    from agl_stream.training.model import set_threads

    set_threads(1)
    answer = local_llm(policy).complete(
        f"<bos> {task['letter']}", max_new_tokens=ANSWER_WORDS, resources_id=rollout.resources_id
    )
    return score(task["letter"], answer.text)


@dataclass
class Member:
    name: str
    args: list[str]
    process: asyncio.subprocess.Process | None = None
    lives: list[int] = field(default_factory=list)  # pids, in order


class Crew:
    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs = env, logs
        self.members: dict[str, Member] = {}
        self.restarts = 0
        self.stopped_while_starting = 0
        self.unclean_exits: list[str] = []

    async def start(self, name: str, *args: str) -> None:
        member = self.members.setdefault(name, Member(name, list(args)))
        with (self.logs / f"{name}.log").open("ab") as out:
            member.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "agl_stream.cli.main", "worker", *member.args,
                "--worker-id", name, "--heartbeat", "2", env=self.env, stdout=out, stderr=out,
            )  # fmt: skip
        member.lives.append(member.process.pid)

    async def restart(self, name: str, how: signal.Signals) -> None:
        member = self.members[name]
        assert member.process is not None
        member.process.send_signal(how)
        try:
            code = await asyncio.wait_for(member.process.wait(), 90)
        except TimeoutError:
            self.unclean_exits.append(f"{name} did not stop within 90 s of {how.name}")
            member.process.kill()
            await member.process.wait()
            code = 0
        if how == signal.SIGTERM and code == -signal.SIGTERM:
            self.stopped_while_starting += 1  # before its handler was installed: nothing held
        elif how == signal.SIGTERM and code != 0:
            self.unclean_exits.append(f"{name} exited {code} on SIGTERM")
        self.restarts += 1
        await self.start(name)

    def pids(self) -> dict[str, int]:
        return {
            n: m.process.pid
            for n, m in self.members.items()
            if m.process is not None and m.process.returncode is None
        }

    async def died(self) -> list[str]:
        """Members that exited without being told (started again)."""
        dead = [
            n for n, m in self.members.items() if m.process and m.process.returncode is not None
        ]
        for name in dead:
            self.unclean_exits.append(f"{name} exited by itself")
            await self.start(name)
        return dead

    async def stop(self) -> None:
        for member in self.members.values():
            if member.process is not None and member.process.returncode is None:
                member.process.terminate()
        for member in self.members.values():
            if member.process is not None:
                try:
                    await asyncio.wait_for(member.process.wait(), 90)
                except TimeoutError:
                    self.unclean_exits.append(f"{member.name} did not stop at the end")
                    member.process.kill()


def overrides(directory: Path, retention_ms: int) -> None:
    segment_ms = max(min(60_000, retention_ms // 2), 1000)
    for name in SHORT_LIVED:
        (directory / f"{name}.toml").write_text(
            f'name = "{name}"\nretention_ms = {retention_ms}\nsegment_ms = {segment_ms}\n'
        )


async def group_lag(kafka: KafkaSettings, groups: dict[str, list[str]]) -> dict[str, int]:
    """Records behind the end, per consumer group, over the topics it reads."""
    topics = Topics(kafka)
    out: dict[str, int] = {}
    async with admin_client(kafka) as admin:
        for group, names in groups.items():
            tps = [
                TopicPartition(topics.name(n), p)
                for n in names
                for p in range(topics.specs[n].partitions)
            ]
            # (a group the broker is still loading answers "no coordinator" for a moment)
            committed = await retrying(
                functools.partial(admin.list_consumer_group_offsets, group, partitions=tps),
                f"reading the offsets of {group}",
            )
            ends = await end_offsets(kafka, tps)
            out[group] = sum(
                max(0, ends[tp] - max(committed[tp].offset, 0)) if tp in committed else ends[tp]
                for tp in tps
            )
    return out


async def progress(conn: asyncpg.Connection, prefix: str) -> int:
    row = await conn.fetchval(
        "SELECT count(*) FROM read_model_1.rollouts WHERE rollout_id LIKE $1 AND status = ANY($2)",
        f"{prefix}%", list(TERMINAL),
    )  # fmt: skip
    return int(row)


async def takeover_ms(conn: asyncpg.Connection) -> int:
    value = await conn.fetchval(
        "SELECT max((counts->>'takeover_ms_last')::int) FROM read_model_1.workers "
        "WHERE role = 'runner'"
    )
    return int(value or 0)


def drift(series: list[float]) -> float | None:
    """RSS at the end of a life against right after warm-up (None: too few samples)."""
    if len(series) < 10:
        return None
    n = len(series)
    settled = 0.97 * statistics.median(series[n // 2 :])
    warm_at = max(n // 4, next(i for i, v in enumerate(series) if v >= settled))
    warm = statistics.median(series[warm_at : max(n // 3, warm_at + 1)])
    end = statistics.median(series[-max(n // 10, 1) :])
    return round((end - warm) / warm, 4)


def lives(samples: list[dict[str, Any]], key: str) -> list[list[float]]:
    """One process role's RSS samples cut into lives: a restart shows as RSS falling by
    more than a tenth from the sample before (a fresh process; a live one only grows or
    wavers by a few percent)."""
    out: list[list[float]] = []
    for value in (s[key] for s in samples if s.get(key) is not None):
        if not out or value < 0.9 * out[-1][-1]:
            out.append([])
        out[-1].append(value)
    return out


def drifts_from_samples(samples: list[dict[str, Any]]) -> dict[str, float]:
    roles = sorted({k for s in samples for k in s if k.endswith("_rss_mb")} - {"broker_rss_mb"})
    out = {}
    for key in roles:
        for i, series in enumerate(lives(samples, key)):
            value = drift(series)
            if value is not None:
                out[f"{key.removesuffix('_rss_mb')} (life {i + 1})"] = value
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    """On the embedded stack (started if it is not running), fresh topics and database."""
    run = f"s{uuid.uuid4().hex[:6]}"
    work = Path(tempfile.mkdtemp(prefix=f"agl-soak-{run}-"))
    os.environ["AGL_STREAM_TOPICS_DIR"] = str(soak_topics(work, args.retention_minutes))
    state, kafka = await fresh_topics(f"soak-{run}")
    database = load(DatabaseSettings, database_url=state.database_url).with_database(f"soak_{run}")
    await migrate(database)
    try:
        return await soak(kafka, database, state.broker_pids, work, args)
    finally:
        await _drop(database, f"soak_{run}")


def soak_topics(work: Path, retention_minutes: float) -> Path:
    """The topic overrides of a soak run (short retention), in a folder of `work`."""
    (work / "topics").mkdir(parents=True, exist_ok=True)
    overrides(work / "topics", int(retention_minutes * 60_000))
    return work / "topics"


async def soak(
    kafka: KafkaSettings,
    database: DatabaseSettings,
    broker_pids: list[int],
    work: Path,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The soak itself, on topics and a database that exist (created with soak_topics)."""
    run = f"s{uuid.uuid4().hex[:6]}"
    env = {**child_environment(kafka, database), "AGL_STREAM_TOPICS_DIR": str(work / "topics")}
    (work / "logs").mkdir()
    crew = Crew(env, work / "logs")
    runner_args = ["--role", "runner", "--agent", "benchmarks.soak:soak_agent",
                   "--concurrency", str(args.concurrency), "--grace", "5"]  # fmt: skip
    for i in range(args.runners):
        await crew.start(f"runner-{i}", *runner_args)
    await crew.start("projector", "--role", "projector")
    await crew.start(
        "trainer", "--role", "trainer", "--checkpoint-dir", str(work / "checkpoints"),
        "--run-name", run, "--group-size", "4", "--groups-per-step", "2", "--start", "latest",
    )  # fmt: skip
    groups = {
        runner_group(kafka.topic_prefix): ["tasks"],
        projector_group(kafka.topic_prefix): ["tasks", "rollouts", "spans"],
        # The trainer commits at its steps only: its lag is what it read since the last one.
        trainer_group(kafka.topic_prefix): ["tasks", "rollouts", "spans"],
    }
    lag_names = dict(zip(groups, ("runners_lag", "projector_lag", "trainer_lag"), strict=True))
    prefix = f"{run}-"
    rate = args.rollouts / (args.minutes * 60)
    samples: list[dict[str, Any]] = []
    rss: dict[tuple[str, int], list[float]] = {}
    sent, stalled_since, longest_stall, last_done = 0, None, 0.0, -1
    conn = await asyncpg.connect(database.asyncpg_dsn)
    began = time.monotonic()
    next_sample = next_restart = began + args.sample_every
    next_other = began + args.others_every
    rotation = 0
    try:
        async with producer(kafka, linger_ms=5) as prod:
            publisher = EventPublisher(prod, Topics(kafka))
            train = RolloutOptions(mode=RolloutMode.TRAIN)
            val = RolloutOptions(mode=RolloutMode.VAL)
            with console.status("soaking...") as status:
                while True:
                    now = time.monotonic()
                    owed = min(int(rate * (now - began)), args.rollouts) - sent
                    if owed > 0:
                        # Train tasks repeat (one per letter) so that they fill the trainer's
                        # groups; the 1M run of 2026-11-25 gave each a unique input, and the
                        # trainer held every one waiting for a group (its RSS grew 9%).
                        events = [
                            make_rollout(
                                {"letter": "abcde"[(n // args.train_every) % 5]}
                                if n % args.train_every == 0
                                else {"n": n, "letter": "abcde"[n % 5]},
                                train if n % args.train_every == 0 else val,
                                f"{prefix}{n}",
                            )
                            for n in range(sent, sent + owed)
                        ]
                        await asyncio.gather(*[await publisher.send("tasks", e) for e in events])
                        sent += owed
                    if now >= next_restart and args.runners > 1:
                        rotation += 1
                        how = signal.SIGTERM if rotation % 2 else signal.SIGKILL
                        await crew.restart(f"runner-{1 + rotation % (args.runners - 1)}", how)
                        next_restart += args.restart_every
                    if now >= next_other:
                        await crew.restart("projector", signal.SIGKILL)
                        await crew.restart("trainer", signal.SIGKILL)
                        next_other += args.others_every
                    await crew.died()
                    if now >= next_sample:
                        done = await progress(conn, prefix)
                        if done < sent and done == last_done:
                            stalled_since = stalled_since or now
                            longest_stall = max(longest_stall, now - stalled_since)
                        else:
                            stalled_since = None
                        last_done = done
                        row: dict[str, Any] = {
                            "t": round(now - began), "sent": sent, "terminal": done,
                            "takeover_ms": await takeover_ms(conn),
                        }  # fmt: skip
                        lags = await group_lag(kafka, groups)
                        row.update({lag_names[g]: n for g, n in lags.items()})
                        for name, pid in crew.pids().items():
                            with_pid = (name, pid)
                            try:
                                rss.setdefault(with_pid, []).append(sample(pid).rss_mb)
                            except OSError:
                                continue
                            row[f"{name}_rss_mb"] = round(rss[with_pid][-1], 1)
                        for i, pid in enumerate(broker_pids):
                            name = "broker" if len(broker_pids) == 1 else f"broker-{i + 1}"
                            row[f"{name}_rss_mb"] = round(sample(pid).rss_mb, 1)
                        samples.append(row)
                        status.update(
                            f"soaking: {sent:,} queued, {done:,} terminal, "
                            f"{crew.restarts} restarts, {now - began:.0f} s"
                        )
                        next_sample += args.sample_every
                        if sent >= args.rollouts and done >= sent:
                            break
                        if now - began > args.minutes * 60 + args.drain_seconds:
                            break
                    await asyncio.sleep(0.05)
    finally:
        await crew.stop()
    done = await progress(conn, prefix)
    twice = await conn.fetchval(
        "SELECT count(*) FROM (SELECT rollout_id FROM read_model_1.attempts "
        "WHERE rollout_id LIKE $1 AND status = 'succeeded' GROUP BY rollout_id "
        "HAVING count(*) > 1) AS doubled",
        f"{prefix}%",
    )
    await conn.close()
    topics = Topics(kafka)
    firsts = await _log_starts(kafka, [TopicPartition(topics.name("tasks"), 0)])
    drifts = {f"{name} (pid {pid})": drift(series) for (name, pid), series in rss.items()}
    return {
        "rollouts": sent, "minutes": round((time.monotonic() - began) / 60, 1),
        "runners": args.runners, "restarts": crew.restarts,
        "stopped_while_starting": crew.stopped_while_starting,
        "lost": sent - done, "run_twice": int(twice),
        "longest_stall_s": round(longest_stall, 1),
        "unclean_exits": crew.unclean_exits,
        "tasks_log_start": firsts, "retention_minutes": args.retention_minutes,
        "rss_drift": {k: v for k, v in drifts.items() if v is not None},
        "max_takeover_ms": max((s["takeover_ms"] for s in samples), default=0),
        "samples": samples, "logs": str(work / "logs"),
        "plot": str(plot(samples, work / "soak.png")),
    }  # fmt: skip


async def _drop(database: DatabaseSettings, name: str) -> None:
    admin = await asyncpg.connect(database.with_database("postgres").asyncpg_dsn)
    try:
        await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
    finally:
        await admin.close()


async def _log_starts(kafka: KafkaSettings, tps: list[TopicPartition]) -> int:
    """The first offset still kept on the tasks topic's partition 0 (> 0: retention deleted)."""
    from agl_stream.bus.kafka import consumer

    async with consumer(kafka) as reader:
        starts = await reader.beginning_offsets(tps)
    return int(sum(starts.values()))


def plot(samples: list[dict[str, Any]], path: Path) -> Path:
    """RSS of each process and the runners' and projector's lag over the run (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (memory, lag) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    t = [s["t"] / 60 for s in samples]
    for key in sorted({k for s in samples for k in s if k.endswith("_rss_mb")}):
        memory.plot(t, [s.get(key) for s in samples], label=key.removesuffix("_rss_mb"))
    memory.set_ylabel("RSS (MB)")
    memory.legend(fontsize="small", ncol=3)
    for key in ("runners_lag", "projector_lag"):
        lag.plot(t, [s.get(key, 0) for s in samples], label=key.removesuffix("_lag"))
    lag.set_ylabel("records behind")
    lag.set_xlabel("minutes")
    lag.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


def report(result: dict[str, Any]) -> None:
    table = Table(title="soak", title_justify="left", show_header=False)
    keys = ("rollouts", "minutes", "runners", "restarts", "stopped_while_starting", "lost",
            "run_twice", "longest_stall_s", "max_takeover_ms", "tasks_log_start",
            "unclean_exits", "plot", "logs")  # fmt: skip
    for key in keys:
        table.add_row(key, str(result[key]))
    console.print(table)
    drift_table = Table(title="RSS drift after warm-up", title_justify="left")
    drift_table.add_column("process")
    drift_table.add_column("drift", justify="right")
    for name, value in sorted(result["rss_drift"].items()):
        drift_table.add_row(name, f"{value:+.1%}")
    console.print(drift_table)
    samples = result["samples"]
    if samples:
        over_time = Table(title="over time (RSS in MB)", title_justify="left")
        columns = [
            "t", "terminal", "takeover_ms", "runners_lag", "projector_lag",
            "runner-0_rss_mb", "projector_rss_mb", "trainer_rss_mb", "broker_rss_mb",
        ]  # fmt: skip
        for column in columns:
            over_time.add_column(column.removesuffix("_rss_mb").replace("_", " "), justify="right")
        step = max(len(samples) // 20, 1)
        for row in samples[::step]:
            over_time.add_row(*(str(row.get(c, "")) for c in columns))
        console.print(over_time)


def parser() -> argparse.ArgumentParser:
    p = benchmark_parser(__doc__)
    p.add_argument("--rollouts", type=int, default=1_000_000)
    p.add_argument("--minutes", type=float, default=60)
    p.add_argument("--runners", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--train-every", type=int, default=200)
    p.add_argument("--retention-minutes", type=float, default=10)
    p.add_argument("--restart-every", type=float, default=60, help="seconds between restarts")
    p.add_argument("--others-every", type=float, default=600, help="projector/trainer kills")
    p.add_argument("--sample-every", type=float, default=10)
    p.add_argument("--drain-seconds", type=float, default=300, help="to finish after queuing")
    return p


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--from-json":
        saved = json.loads(Path(sys.argv[2]).read_text())
        saved["rss_drift"] = drifts_from_samples(saved["samples"])
        report(saved)
    else:
        run_benchmark(parser(), main, report)
