"""Learning from production traffic: `agl-stream reward` (late and external rewards),
`agl-stream ingest otlp` (spans from other systems) and `agl-stream export` (datasets)."""

from __future__ import annotations

import contextlib
import math
from datetime import datetime

import click

from agl_stream.cli.common import (
    AppContext,
    PathType,
    console,
    err_console,
    friendly_errors,
    parse_key_values,
    read_model_option,
    run,
)
from agl_stream.cli.times import TIME
from agl_stream.events import DEFAULT_REWARD_NAME


def _finite(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a number", param_hint="VALUE") from None
    if not math.isfinite(number):
        raise click.BadParameter(f"{value!r} is not a finite number", param_hint="VALUE")
    return number


@click.command("reward", context_settings={"ignore_unknown_options": True})
@click.argument("rollout_id")
@click.argument("value")
@click.option("--name", default=DEFAULT_REWARD_NAME, show_default=True, help="Which reward.")
@click.option("--attempt", "attempt_id", help="The attempt it is for (default: the rollout).")
@click.option("--call", "span_id", metavar="SPAN_ID", help="The LLM call span it is for.")
@click.option("--source", default="cli", show_default=True, help="Who gives it.")
@click.option("--metadata", multiple=True, metavar="KEY=VALUE", help="Repeatable.")
@click.option("--given-at", type=TIME, help="When it was given (default: now).")
@click.pass_obj
@friendly_errors
def reward_command(
    app: AppContext,
    /,
    rollout_id: str,
    value: str,
    name: str,
    attempt_id: str | None,
    span_id: str | None,
    source: str,
    metadata: tuple[str, ...],
    given_at: datetime | None,
) -> None:
    """Give ROLLOUT_ID a reward of VALUE, now or long after it ran (feedback, a label, a CI
    result). It counts once an attempt of the rollout is on the rollouts topic: a reward for
    an unknown rollout or attempt goes to the dead-letter topic with the reason
    (`agl-stream dlq list`). `agl-stream query rewards ROLLOUT_ID` shows those that counted."""
    from agl_stream.commands.rewards import BadReward, RewardSender, make_reward

    try:
        event = make_reward(
            rollout_id, _finite(value), name=name, attempt_id=attempt_id, span_id=span_id,
            source=source, metadata=parse_key_values(metadata, "--metadata"), given_at=given_at,
        )  # fmt: skip
    except BadReward as exc:
        raise click.UsageError(str(exc)) from None

    async def send() -> None:
        async with RewardSender(app.kafka()) as sender:
            landed = await sender.send_event(event)
        console.print(
            f"reward {event.name}={event.value:g} for {rollout_id} recorded "
            f"({landed.topic}[{landed.partition}]@{landed.offset}, event {event.event_id})",
            highlight=False,
        )

    run(send())


@click.group()
def ingest() -> None:
    """Spans from systems that are not agl-stream runners."""


@ingest.command("otlp")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=4318, show_default=True)
@click.option("--no-http", is_flag=True, help="No OTLP/HTTP receiver (only --collector-topic).")
@click.option(
    "--token",
    envvar="AGL_STREAM_OTLP_TOKEN",
    metavar="TOKEN",
    help="Bearer token the receiver requires, and the secret of attempt keys. [env: "
    "AGL_STREAM_OTLP_TOKEN; default: AGL_STREAM_API_TOKEN, else none]",
)
@click.option(
    "--collector-topic",
    metavar="TOPIC",
    help="Also read this topic of an OpenTelemetry Collector's Kafka exporter (otlp_proto "
    "encoding), on the same brokers, whole name (no prefix).",
)
@click.option("--group", "group_id", help="Consumer group for --collector-topic.")
@click.option(
    "--idle-timeout",
    "idle_timeout",
    type=click.FloatRange(min=0),
    envvar="AGL_STREAM_OTLP_IDLE_TIMEOUT",
    default=300.0,
    show_default=True,
    help="End an ingested attempt after this many seconds without a span (succeeded, so a "
    "trainer takes it); 0: never. [env: AGL_STREAM_OTLP_IDLE_TIMEOUT]",
)
@click.pass_obj
@friendly_errors
def ingest_otlp(
    app: AppContext,
    /,
    host: str,
    port: int,
    no_http: bool,
    token: str | None,
    collector_topic: str | None,
    group_id: str | None,
    idle_timeout: float,
) -> None:
    """Take OpenTelemetry spans as rollouts: an OTLP/HTTP receiver (POST /v1/traces,
    protobuf or JSON) and/or a Collector's Kafka topic. Spans map to rollouts and attempts by
    their `agl.rollout.id` and `agl.attempt.id` attributes (span, then resource); spans
    without them are one unattributed rollout per trace (`otlp-trace-<trace id>`). A payload
    that cannot be read, or that names an attempt no ingester started without its key
    (`agl.attempt.key`), gets a 400 (or a dead letter) with the reason. Nothing in OTLP says
    that a trace is over: an ingested attempt ends after --idle-timeout without a span."""
    import asyncio

    from agl_stream.bus.kafka import producer
    from agl_stream.bus.roles import group_for
    from agl_stream.bus.streams import EventPublisher, Topics
    from agl_stream.bus.topic_admin import ensure_topics_ready
    from agl_stream.cli.common import listening_on, stop_on_signals
    from agl_stream.otlp.closer import end_idle_attempts
    from agl_stream.otlp.ingest import OtlpIngest, OtlpReceiver, consume_collector_topic
    from agl_stream.runtime.supervision import restarting

    if no_http and collector_topic is None:
        raise click.UsageError("nothing to ingest: --no-http needs --collector-topic")
    if not token:  # (an empty AGL_STREAM_OTLP_TOKEN is none)
        token = app.auth().token  # AGL_STREAM_API_TOKEN, as every server of the process
    kafka = app.kafka()
    group = group_id or f"{kafka.topic_prefix.rstrip('.')}-otlp-ingest"

    async def main() -> None:
        stop = stop_on_signals()
        await ensure_topics_ready(kafka, ("rollouts", "spans", "dlq"))
        async with producer(kafka) as prod:
            ingester = OtlpIngest(EventPublisher(prod, Topics(kafka)), token)
            receiver = OtlpReceiver(ingester, token)
            if not no_http:
                with listening_on(f"{host}:{port}"):
                    url = await receiver.start(host, port)
                console.print(f"OTLP/HTTP receiver on {url}/v1/traces", highlight=False)
            jobs: list[asyncio.Task[object]] = [asyncio.create_task(stop.wait())]
            if collector_topic is not None:
                # A failure (the broker away a while) is logged and the consumer starts again
                # from the group's committed offsets: nothing is lost, spans are deduplicated.
                following = restarting(
                    lambda: consume_collector_topic(
                        kafka, ingester, prod, collector_topic, group, stop
                    ),
                    f"reading {collector_topic}",
                )
                jobs.append(asyncio.create_task(following))
                console.print(f"reading {collector_topic} as group {group}", highlight=False)
            if idle_timeout > 0:
                # Ingesters side by side share this group's partitions; a failure is logged
                # and it starts again from the cut it committed.
                idle_group = group_for(kafka.topic_prefix, "otlp-idle")
                ending = restarting(
                    lambda: end_idle_attempts(
                        kafka, idle_timeout, idle_group, stop, ingester.counts
                    ),
                    "ending idle attempts",
                )
                jobs.append(asyncio.create_task(ending))
            try:
                done, _ = await asyncio.wait(jobs, return_when=asyncio.FIRST_COMPLETED)
                for job in done:
                    job.result()  # a consumer that failed ends the command with its error
            finally:
                stop.set()
                await asyncio.gather(*jobs, return_exceptions=True)
                await receiver.stop()
                console.print(f"ingested: {ingester.counts}", highlight=False)

    run(main())


@click.command("export")
@click.option(
    "--format", "fmt", type=click.Choice(["jsonl", "parquet"]), default="jsonl", show_default=True
)
@click.option(
    "--kind",
    type=click.Choice(["transcripts", "triplets", "pairs"]),
    default="transcripts",
    show_default=True,
    help="Conversations with rewards (SFT), LLM calls with token ids (RL), or chosen/rejected "
    "pairs of one task's attempts (DPO).",
)
@click.option("-o", "--output", type=PathType(dir_okay=False), help="File (JSONL: default stdout).")
@click.option(
    "--status",
    "statuses",
    multiple=True,
    default=("succeeded",),
    show_default=True,
    type=click.Choice(["succeeded", "failed", "timeout", "unresponsive"]),
    help="Attempts that ended so (repeatable).",
)
@click.option("--mode", "modes", multiple=True, type=click.Choice(["train", "val", "test"]))
@click.option(
    "--metadata", multiple=True, metavar="KEY=VALUE", help="Rollout metadata; repeatable."
)
@click.option(
    "--since", type=TIME, help="Attempts that finished from this time (ISO 8601 or an age)."
)
@click.option("--until", type=TIME, help="Attempts that finished before this time.")
@click.option(
    "--reward",
    "reward_name",
    metavar="NAME",
    help="Each attempt's reward is the late reward NAME (`agl-stream reward`) instead of its own.",
)
@click.option("--min-reward", type=float, help="Only attempts whose reward reaches this.")
@click.option(
    "--policy",
    metavar="NAME",
    help="Only the LLM calls of this policy (several policies trained together; calls that "
    "name none are 'policy''s).",
)
@read_model_option("Export from")
@click.pass_obj
@friendly_errors
def export_command(
    app: AppContext,
    /,
    fmt: str,
    kind: str,
    output: str | None,
    statuses: tuple[str, ...],
    modes: tuple[str, ...],
    metadata: tuple[str, ...],
    since: datetime | None,
    until: datetime | None,
    reward_name: str | None,
    min_reward: float | None,
    policy: str | None,
    read_model: str | None,
) -> None:
    """Export datasets from the read model: transcripts and triplets with their rewards, or
    preference pairs, as JSON Lines or Parquet, streamed (constant memory at any size)."""
    import sys
    from pathlib import Path

    from agl_stream.export.run import export
    from agl_stream.export.source import ExportError, ExportFilter, attempts
    from agl_stream.export.writers import JsonlWriter, ParquetWriter, Writer

    if fmt == "parquet" and output is None:
        raise click.UsageError("--format parquet writes a file: give --output")
    if min_reward is not None and not math.isfinite(min_reward):
        raise click.BadParameter("give a finite number", param_hint="--min-reward")
    try:
        chosen = ExportFilter(
            attempt_status=statuses, modes=modes,
            metadata=parse_key_values(metadata, "--metadata") or None, since=since, until=until,
            reward_name=reward_name, min_reward=min_reward, by_group=kind == "pairs",
            policy=policy,
        )  # fmt: skip
    except ExportError as exc:
        raise click.UsageError(str(exc)) from None
    database = app.database()

    async def go(writer: Writer) -> None:
        try:
            counts = await export(kind, attempts(database.asyncpg_dsn, chosen, read_model), writer)
        except ExportError as exc:
            raise click.UsageError(str(exc)) from None
        err_console.print(
            f"exported {counts.rows:,} {kind} from {counts.attempts:,} attempts "
            f"({counts.calls:,} LLM calls)" + (f" to {output}" if output else ""),
            highlight=False,
        )

    if fmt == "parquet":
        assert output is not None
        try:
            parquet = ParquetWriter(Path(output), kind)
        except RuntimeError as exc:  # no pyarrow
            raise click.UsageError(str(exc)) from None
        run(go(parquet))
        return
    with open(output, "wb") if output else contextlib.nullcontext(sys.stdout.buffer) as handle:
        run(go(JsonlWriter(handle)))
