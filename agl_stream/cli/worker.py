"""`agl-stream worker runner|projector|trainer`: one command per role, each with its own
options; what every worker takes is declared once (`worker_options`). `worker --role ROLE`
and AGL_CURRENT_ROLE (Agent Lightning's names: `algorithm` is the trainer) pick the role
too. Consumer groups and option bounds come from the role specs (workers/*.toml), defaults
from the workers' config dataclasses."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import click

from agl_stream.agent.api import LitAgent, load_agent
from agl_stream.agent.process import ProcessAgent
from agl_stream.bus.roles import role
from agl_stream.cli.apo import apo_config, apo_options, run_apo
from agl_stream.cli.common import AppContext, console, friendly_errors, stop_on_signals
from agl_stream.cli.train import each_policy, run_trainer, trainer_config, trainer_options
from agl_stream.projection.projector import Projector, ProjectorConfig
from agl_stream.runner.worker import Runner, RunnerConfig
from agl_stream.runtime.config import current_role, load
from agl_stream.runtime.gc_tuning import tune_for_throughput
from agl_stream.runtime.redaction import RedactionSettings
from agl_stream.telemetry.metrics import serving_metrics
from agl_stream.telemetry.otlp import exporting

ROLES = ("runner", "projector", "trainer")


def default(config: type[Any], name: str) -> Any:
    """A config dataclass's default for one field: the one place a worker's defaults live."""
    found = {f.name: f for f in dataclasses.fields(config)}[name]
    assert found.default is not dataclasses.MISSING, f"{config.__name__}.{name} has no default"
    return found.default


def bounded(role_name: str, option: str) -> click.IntRange:
    """An option's bounds as its role's spec gives them."""
    least, most = role(role_name).limit(option)
    return click.IntRange(least, most)


class RoleGroup(click.Group):
    """`worker ROLE ...`; `--role ROLE` among the arguments, or AGL_CURRENT_ROLE when neither
    names one, mean the same."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        args = list(args)
        chosen = None
        for i, arg in enumerate(args):
            if arg == "--role" and i + 1 < len(args):
                chosen = args[i + 1]
                del args[i : i + 2]
                break
            if arg.startswith("--role="):
                chosen = arg.partition("=")[2]
                del args[i]
                break
        asks_help = any(a in ctx.help_option_names for a in args)
        if chosen is None and not (args and args[0] in self.commands) and not asks_help:
            chosen = current_role()
            if chosen is None:
                raise click.UsageError(
                    "say which worker to run: agl-stream worker runner|projector|trainer "
                    "(or --role ROLE, or set AGL_CURRENT_ROLE)",
                    ctx,
                )
        if chosen is not None:
            if chosen not in self.commands:
                raise click.UsageError(
                    f"there is no worker role {chosen!r}: choose runner, projector or trainer",
                    ctx,
                )
            args.insert(0, chosen)
        return super().parse_args(ctx, args)


def worker_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """What every role takes."""
    options = [
        click.option("--worker-id",
                     help="Name in heartbeats and attempts. [default: ROLE-HOST-PID]"),
        click.option("--group", help="Consumer group. [default: the role's, after the topic "
                     "prefix: agl-runners, agl-projector, agl-trainer]"),
        click.option("--heartbeat", type=click.FloatRange(0.1), show_default=True,
                     default=default(RunnerConfig, "heartbeat_seconds"),
                     help="Seconds between heartbeats."),
        click.option("--metrics-port", type=click.IntRange(0, 65535), default=0,
                     show_default=True, envvar="AGL_STREAM_METRICS_PORT",
                     help="Serve Prometheus metrics on this port at /metrics (0: off). "
                          "[env: AGL_STREAM_METRICS_PORT]"),
        click.option("--metrics-host", default="127.0.0.1", show_default=True,
                     envvar="AGL_STREAM_METRICS_HOST",
                     help="Address the metrics endpoint listens on (0.0.0.0 for a Prometheus on "
                          "another machine). [env: AGL_STREAM_METRICS_HOST]"),
        click.option("-v", "--verbose", is_flag=True, help="Log what the worker does."),
    ]  # fmt: skip
    for option in reversed(options):
        func = option(func)
    return func


def session_timeout_option(config: type[Any]) -> Callable[..., Any]:
    return click.option(
        "--session-timeout-ms", type=click.IntRange(6000), show_default=True,
        default=default(config, "session_timeout_ms"),
        help="How soon the group notices a member died.",
    )  # fmt: skip


@click.group(cls=RoleGroup)
def worker() -> None:
    """Run a worker: a runner, a projector or a trainer (`agl-stream worker ROLE --help`).

    `agl-stream worker --role ROLE` and AGL_CURRENT_ROLE choose the role too.
    """


@worker.command(
    help=role("runner").summary
    + """

    Stop it with Ctrl-C or SIGTERM: it finishes what it runs within --grace seconds and
    hands back the rest; after a kill -9 another runner takes over its partitions."""
)
@click.option("--agent", "agent_spec", metavar="MODULE:ATTR", help="The agent to run.")
@click.option(
    "--agent-command",
    metavar='"CMD ..."',
    help="Run this command as the agent, one process per attempt, in any language: it gets "
    "AGL_OPENAI_BASE_URL, AGL_EVENT_URL, AGL_KEY and AGL_TASK_INPUT (docs: Process agents).",
)
@click.option(
    "--concurrency", type=bounded("runner", "concurrency"), show_default=True,
    default=default(RunnerConfig, "concurrency"), help="Rollouts it runs at once.",
)  # fmt: skip
@click.option(
    "--linger-ms", type=bounded("runner", "linger_ms"), show_default=True,
    default=default(RunnerConfig, "linger_ms"),
    help="How long it gathers events before sending them. Longer: fewer, larger writes on "
    "the broker's storage (more rollouts/s when it is the bottleneck), each rollout later.",
)  # fmt: skip
@click.option(
    "--grace", type=click.FloatRange(0), show_default=True,
    default=default(RunnerConfig, "shutdown_grace_seconds"),
    help="Seconds to finish in-flight rollouts on SIGTERM before handing them back.",
)  # fmt: skip
@session_timeout_option(RunnerConfig)
@click.option(
    "--gateway/--no-gateway", default=default(RunnerConfig, "gateway"), show_default=True,
    help="Run the LLM gateway in the runner: agents' LLM resources get per-attempt URLs on it "
    "and every call is recorded with its token ids.",
)  # fmt: skip
@click.option("--gateway-host", default=default(RunnerConfig, "gateway_host"), show_default=True,
              help="Address the runner's gateway listens on (agents reach it there).")  # fmt: skip
@click.option(
    "--gateway-port", type=click.IntRange(0, 65535), show_default=True,
    default=default(RunnerConfig, "gateway_port"),
    help="Port of the runner's gateway (0: any free port).",
)  # fmt: skip
@click.option(
    "--redact-key", multiple=True, metavar="GLOB",
    help="Replace the value of span attributes so named (case-insensitive glob, repeatable), "
    "besides those of AGL_STREAM_REDACT_KEYS (default: names of secrets such as *password*, "
    "*api_key*, *authorization*).",
)  # fmt: skip
@click.option(
    "--redact-pattern", multiple=True, metavar="NAME|REGEX",
    help="Replace what this matches in span attribute values: email, api_key or a regular "
    "expression (repeatable; besides AGL_STREAM_REDACT_PATTERNS, a JSON list).",
)  # fmt: skip
@worker_options
@click.pass_obj
@friendly_errors
def runner(
    app: AppContext,
    /,
    agent_spec: str | None,
    agent_command: str | None,
    concurrency: int,
    linger_ms: int,
    grace: float,
    session_timeout_ms: int,
    gateway: bool,
    gateway_host: str,
    gateway_port: int,
    redact_key: tuple[str, ...],
    redact_pattern: tuple[str, ...],
    worker_id: str | None,
    group: str | None,
    heartbeat: float,
    metrics_port: int,
    metrics_host: str,
    verbose: bool,
) -> None:
    _logging(verbose)
    agent, agent_name = _runner_agent(agent_spec, agent_command, gateway)
    tokens = app.auth()
    configured = load(RedactionSettings)
    redaction = load(
        RedactionSettings,
        redact_keys=[*configured.redact_keys, *redact_key],
        redact_patterns=[*configured.redact_patterns, *redact_pattern],
    ).rules()
    config = RunnerConfig(
        agent=agent, concurrency=concurrency, group_id=group, shutdown_grace_seconds=grace,
        heartbeat_seconds=heartbeat, session_timeout_ms=session_timeout_ms,
        gateway=gateway, gateway_host=gateway_host, gateway_port=gateway_port,
        linger_ms=linger_ms, gateway_token=tokens.token, upstream_token=tokens.upstream,
        redaction=redaction,
    )  # fmt: skip
    if worker_id:
        config.worker_id = worker_id
    runner = Runner(app.kafka(), config)
    console.print(
        f"runner {config.worker_id}: agent {agent_name}, concurrency {concurrency}",
        highlight=False,
    )
    asyncio.run(_run_until_signal(runner, metrics_host, metrics_port, tokens.token))
    console.print(f"runner {config.worker_id} stopped: {dict(runner.counts)}", highlight=False)


@worker.command(
    help=role("projector").summary
    + """

    Exactly once in effect; run several to share the partitions. `agl-stream query` reads
    what it writes."""
)
@click.option("--batch-size", type=bounded("projector", "batch_size"), show_default=True,
              default=default(ProjectorConfig, "max_batch"),
              help="Most records it applies in one transaction.")  # fmt: skip
@session_timeout_option(ProjectorConfig)
@worker_options
@click.pass_obj
@friendly_errors
def projector(
    app: AppContext,
    /,
    batch_size: int,
    session_timeout_ms: int,
    worker_id: str | None,
    group: str | None,
    heartbeat: float,
    metrics_port: int,
    metrics_host: str,
    verbose: bool,
) -> None:
    _logging(verbose)
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


@worker.command(
    help=role("trainer").summary
    + """

    One per run: it writes a checkpoint per step to --checkpoint-dir and publishes it as a
    resources version; killed and restarted, it goes on from its latest checkpoint.

    With --algorithm apo it improves a prompt template instead: it queues rollouts pinned to
    candidate templates, has the optimizer LLM critique the worst and rewrite the template,
    keeps the best by mean reward on --val-tasks and publishes it (needs a projector: it
    reads results from the read model). Its state lives in --checkpoint-dir."""
)
@trainer_options
@apo_options
@worker_options
@click.pass_obj
@friendly_errors
def trainer(
    app: AppContext,
    /,
    worker_id: str | None,
    group: str | None,
    heartbeat: float,
    metrics_port: int,
    metrics_host: str,
    verbose: bool,
    **options: Any,
) -> None:
    _logging(verbose)
    if options["algorithm"] == "apo":
        if options.get("agent_match"):
            raise click.UsageError(
                "--agent-match picks the LLM calls GRPO trains on; APO improves a prompt "
                "template from rewards and takes no calls (leave it out)"
            )
        apo = apo_config(options)
        if worker_id:
            apo.worker_id = worker_id
        run_apo(app, apo, metrics_host, metrics_port)
        return
    config = trainer_config(**options)
    if worker_id:
        config.worker_id = worker_id
    if group:
        if len(options.get("policies") or ()) > 1:
            raise click.UsageError("--group names one trainer's group: not with several --policy")
        config.group_id = group
    config.heartbeat_seconds = heartbeat
    run_trainer(app, each_policy(config, options.get("policies") or ()), metrics_host, metrics_port)


def _logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
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
