"""`agl-stream worker --role ...`."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import click

from agl_stream.agent.api import LitAgent, load_agent
from agl_stream.agent.process import ProcessAgent
from agl_stream.cli.apo import apo_config, apo_options, run_apo
from agl_stream.cli.common import AppContext, console, friendly_errors, stop_on_signals
from agl_stream.cli.train import run_trainer, trainer_config, trainer_options
from agl_stream.config import current_role, load
from agl_stream.gc_tuning import tune_for_throughput
from agl_stream.metrics import serving_metrics
from agl_stream.projection.projector import Projector, ProjectorConfig
from agl_stream.redaction import RedactionSettings
from agl_stream.runner.worker import Runner, RunnerConfig
from agl_stream.telemetry.otlp import exporting

ROLES = ("runner", "projector", "trainer")


@click.command()
@click.option(
    "--role",
    type=click.Choice(ROLES),
    default=lambda: current_role(),
    help="What this worker does. [env: AGL_CURRENT_ROLE; its `algorithm` means trainer]",
)
@click.option("--agent", "agent_spec", metavar="MODULE:ATTR", help="The agent a runner runs.")
@click.option(
    "--agent-command",
    metavar='"CMD ..."',
    help="Run this command as the agent, one process per attempt, in any language: it gets "
    "AGL_OPENAI_BASE_URL, AGL_EVENT_URL, AGL_KEY and AGL_TASK_INPUT (see the README).",
)
@click.option(
    "--batch-size",
    type=click.IntRange(1, 100_000),
    default=5000,
    show_default=True,
    help="Most records a projector applies in one transaction.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1, 10_000),
    default=16,
    show_default=True,
    help="Rollouts a runner runs at once.",
)
@click.option(
    "--linger-ms",
    type=click.IntRange(0, 5000),
    default=10,
    show_default=True,
    help="How long a runner gathers events before sending them. Longer: fewer, larger writes "
    "on the broker's storage (more rollouts/s when it is the bottleneck), each rollout later.",
)
@click.option("--worker-id", help="Name in heartbeats and attempts. [default: runner-HOST-PID]")
@click.option(
    "--group",
    help="Consumer group. [default: agl-runners or agl-projector, after the topic prefix]",
)
@click.option(
    "--grace",
    type=click.FloatRange(0),
    default=30.0,
    show_default=True,
    help="Seconds to finish in-flight rollouts on SIGTERM before handing them back.",
)
@click.option(
    "--heartbeat",
    type=click.FloatRange(0.1),
    default=5.0,
    show_default=True,
    help="Seconds between heartbeats.",
)
@click.option(
    "--session-timeout-ms",
    type=click.IntRange(6000),
    default=10_000,
    show_default=True,
    help="How soon the group notices a runner died.",
)
@click.option(
    "--gateway/--no-gateway",
    default=True,
    show_default=True,
    help="Run the LLM gateway in the runner: agents' LLM resources get per-attempt URLs on it "
    "and every call is recorded with its token ids.",
)
@click.option(
    "--gateway-host",
    default="127.0.0.1",
    show_default=True,
    help="Address the runner's gateway listens on (agents reach it there).",
)
@click.option(
    "--gateway-port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="Port of the runner's gateway (0: any free port).",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    envvar="AGL_STREAM_METRICS_PORT",
    help="Serve Prometheus metrics on this port at /metrics (0: off). "
    "[env: AGL_STREAM_METRICS_PORT]",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    envvar="AGL_STREAM_METRICS_HOST",
    help="Address the metrics endpoint listens on (0.0.0.0 for a Prometheus on another "
    "machine). [env: AGL_STREAM_METRICS_HOST]",
)
@click.option(
    "--redact-key",
    multiple=True,
    metavar="GLOB",
    help="Runner: replace the value of span attributes so named (case-insensitive glob, "
    "repeatable), besides those of AGL_STREAM_REDACT_KEYS (default: names of secrets such as "
    "*password*, *api_key*, *authorization*).",
)
@click.option(
    "--redact-pattern",
    multiple=True,
    metavar="NAME|REGEX",
    help="Runner: replace what this matches in span attribute values: email, api_key or a "
    "regular expression (repeatable; besides AGL_STREAM_REDACT_PATTERNS, a JSON list).",
)
@click.option("-v", "--verbose", is_flag=True, help="Log what the worker does.")
@trainer_options
@apo_options
@click.pass_obj
@friendly_errors
def worker(
    app: AppContext,
    /,
    role: str | None,
    agent_spec: str | None,
    agent_command: str | None,
    batch_size: int,
    concurrency: int,
    linger_ms: int,
    worker_id: str | None,
    group: str | None,
    grace: float,
    heartbeat: float,
    session_timeout_ms: int,
    gateway: bool,
    gateway_host: str,
    gateway_port: int,
    metrics_port: int,
    metrics_host: str,
    redact_key: tuple[str, ...],
    redact_pattern: tuple[str, ...],
    verbose: bool,
    **trainer: Any,
) -> None:
    """Run a worker.

    A runner claims rollouts from the tasks topic and runs an agent on them. Stop it with
    Ctrl-C or SIGTERM: it finishes what it runs within --grace seconds and hands back the
    rest; after a kill -9 another runner takes over its partitions.

    A projector writes every event topic into the PostgreSQL read model that `agl-stream
    query` reads, exactly once in effect; run several to share the partitions.

    A trainer (one per run) turns finished train-mode attempts into updates of a policy,
    writes a checkpoint per step to --checkpoint-dir and publishes it as a resources version;
    killed and restarted, it goes on from its latest checkpoint.

    With --algorithm apo the trainer improves a prompt template instead: it queues rollouts
    pinned to candidate templates, has the optimizer LLM critique the worst and rewrite the
    template, keeps the best by mean reward on --val-tasks and publishes it (needs a
    projector: it reads results from the read model). Its state lives in --checkpoint-dir.
    """
    if role is None:
        raise click.UsageError(
            "say which worker to run: --role runner|projector|trainer (or set AGL_CURRENT_ROLE)"
        )
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if role == "projector":
        config = ProjectorConfig(
            group_id=group, max_batch=batch_size, heartbeat_seconds=heartbeat,
            session_timeout_ms=session_timeout_ms,
        )  # fmt: skip
        if worker_id:
            config.worker_id = worker_id
        projector = Projector(app.kafka(), app.database(), config)
        console.print(f"projector {config.worker_id}: group {projector.group_id}", highlight=False)
        asyncio.run(_run_until_signal(projector, metrics_host, metrics_port, app.auth().token))
        console.print(f"projector {config.worker_id} stopped: {dict(projector.counts)}")
        return
    if role == "trainer" and trainer["algorithm"] == "apo":
        apo = apo_config(trainer)
        if worker_id:
            apo.worker_id = worker_id
        run_apo(app, apo, metrics_host, metrics_port)
        return
    if role == "trainer":
        config = trainer_config(**trainer)
        if worker_id:
            config.worker_id = worker_id
        if group:
            config.group_id = group
        config.heartbeat_seconds = heartbeat
        run_trainer(app, config, metrics_host, metrics_port)
        return
    agent, agent_name = _runner_agent(agent_spec, agent_command, gateway)
    tokens = app.auth()
    configured = load(RedactionSettings)
    redaction = load(
        RedactionSettings,
        redact_keys=[*configured.redact_keys, *redact_key],
        redact_patterns=[*configured.redact_patterns, *redact_pattern],
    ).rules()
    runner_config = RunnerConfig(
        agent=agent, concurrency=concurrency, group_id=group, shutdown_grace_seconds=grace,
        heartbeat_seconds=heartbeat, session_timeout_ms=session_timeout_ms,
        gateway=gateway, gateway_host=gateway_host, gateway_port=gateway_port,
        linger_ms=linger_ms, gateway_token=tokens.token, upstream_token=tokens.upstream,
        redaction=redaction,
    )  # fmt: skip
    if worker_id:
        runner_config.worker_id = worker_id
    runner = Runner(app.kafka(), runner_config)
    console.print(
        f"runner {runner_config.worker_id}: agent {agent_name}, concurrency {concurrency}",
        highlight=False,
    )
    asyncio.run(_run_until_signal(runner, metrics_host, metrics_port, tokens.token))
    console.print(
        f"runner {runner_config.worker_id} stopped: {dict(runner.counts)}", highlight=False
    )


def _runner_agent(
    agent_spec: str | None, agent_command: str | None, gateway: bool
) -> tuple[LitAgent, str]:
    if agent_spec is not None and agent_command is not None:
        raise click.UsageError("give a runner --agent or --agent-command, not both")
    if agent_command is not None:
        if not gateway:
            raise click.UsageError(
                "--agent-command needs the runner's gateway (its URLs are the agent's LLM and "
                "event endpoints): leave out --no-gateway"
            )
        try:
            return ProcessAgent(agent_command), agent_command
        except ValueError as exc:  # an empty command, or shlex: "No closing quotation"
            raise click.BadParameter(str(exc), param_hint="--agent-command") from None
    if agent_spec is None:
        raise click.UsageError(
            'a runner needs the agent to run: --agent MODULE:ATTR or --agent-command "CMD ..."'
        )
    try:
        return load_agent(agent_spec), agent_spec
    except (ValueError, TypeError) as exc:
        raise click.BadParameter(str(exc), param_hint="--agent") from None


async def _run_until_signal(
    runner: Runner | Projector, metrics_host: str, metrics_port: int, token: str | None
) -> None:
    if isinstance(runner, Projector):
        # This process is the projector: its own collector settings. Not for runners: their
        # in-flight rollouts outlive young collections, so cyclic garbage (tasks, spans)
        # waited for rare old-generation collections and a runner's RSS grew by half over
        # 10,000 rollouts in the runner benchmark, for no measurable gain.
        tune_for_throughput()
    async with (
        serving_metrics(runner.metrics, metrics_host, metrics_port, token),
        exporting(runner.metrics, runner.config.worker_id),
    ):
        await runner.run(stop_on_signals())
