"""`agl-stream serve` (the policy server) and `agl-stream gateway` (the LLM gateway)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import TYPE_CHECKING, Any

import click

from agl_stream.cli.common import (
    AppContext,
    check_policies,
    console,
    friendly_errors,
    listening_on,
    stop_on_signals,
    torch_options,
)
from agl_stream.cli.engines import build_engine, engine_options, fixed_checkpoint

if TYPE_CHECKING:
    from agl_stream.serving.server import PolicyServer
    from agl_stream.training.device import Placement

# A session quiet this long past the gateway's own wait has lost its gateway.
LOST_SESSION_MARGIN = 60.0


def _worker_id(role: str) -> str:
    """Who this process is in its OTLP export (service.instance.id)."""
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


def _url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise click.BadParameter(f"{value!r} is not an http(s) URL", param_hint="--upstream")
    return value.rstrip("/")


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option(
    "--model",
    "model_spec",
    metavar="tiny|tiny-chat|NAME|FILE.gguf|DIR",
    help="Serve this model as it is, instead of following the resources topic (NAME: a "
    "pretrained model's short name, such as smollm2-135m-instruct).",
)
@click.option(
    "--resource",
    default="policy",
    show_default=True,
    help="Name of the checkpoint resource to serve from each resources version.",
)
@click.option("--pin", metavar="RESOURCES_ID", help="Serve this resources version, not the latest.")
@click.option(
    "--served-model-name", default="policy", show_default=True, help="Model name in answers."
)
@click.option(
    "--policy",
    "policies",
    multiple=True,
    metavar="NAME",
    help="Serve this policy (repeated: several): the checkpoint resource of its name, for "
    "the calls whose model names it. With --engine vllm the policies share one vLLM as LoRA "
    "adapters of one base; with torch each is a model in this process. Instead of "
    "--resource and --served-model-name.",
)
@click.option(
    "--max-batch",
    type=click.IntRange(1, 1024),
    default=32,
    show_default=True,
    help="Most requests generated together.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of tiny models.")
@torch_options
@engine_options
@click.option("-v", "--verbose", is_flag=True, help="Log loads and reloads.")
@click.pass_obj
@friendly_errors
def serve(
    app: AppContext,
    /,
    host: str,
    port: int,
    model_spec: str | None,
    resource: str,
    pin: str | None,
    served_model_name: str,
    policies: tuple[str, ...],
    max_batch: int,
    seed: int,
    device: str | None,
    dtype: str | None,
    threads: int | None,
    verbose: bool,
    **engine: Any,
) -> None:
    """Serve a policy behind the OpenAI API (chat completions and completions, streaming or
    not), with token ids and logprobs in every answer.

    By default it follows the resources topic: it serves the latest version's checkpoint
    (or the --pin'ned one), reloads when a new one is published, and says which version
    answered (`system_fingerprint` and the X-AGL-Resources-Id header). The torch engine runs
    the model in this process on --device in --dtype, batching concurrent requests; the vllm
    engine runs vLLM's server as a child process and reloads it in place (a LoRA adapter
    too), restarting it if it dies. With AGL_STREAM_API_TOKEN set, every call but /health needs
    it as a bearer token.

    With --policy (repeated), it serves several policies, each the resource of its name,
    chosen by the `model` of each call (`/v1/models` lists them); with vLLM they are LoRA
    adapters of one base in one engine.
    """
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING)
    if policies:
        _check_several(check_policies(policies), model_spec, resource, served_model_name, engine)
    from agl_stream.serving.server import PolicyServer
    from agl_stream.telemetry.otlp import exporting
    from agl_stream.training.device import apply_threads, placement

    where = placement(device, dtype, threads)
    apply_threads(where, None)

    token = app.auth().token

    async def main() -> None:
        stop = stop_on_signals()
        several = bool(policies) and engine["engine"] == "torch"  # a torch model per policy
        built = None if several else build_engine(engine, max_batch, where, dtype)
        server = PolicyServer(served_model_name, max_batch, where, built, policies)
        if model_spec is not None:
            await _load_fixed(server, model_spec, seed, where)
        with listening_on(f"{host}:{port}"):
            url = await server.start(host, port, token)
        names = ", ".join(policies) if policies else served_model_name
        console.print(f"serving {names} on {url}/v1 ({where.describe()})", highlight=False)
        try:
            async with exporting(server.metrics, _worker_id("policy-server")):
                follower = (
                    None if model_spec else asyncio.create_task(_follow(app, server, resource, pin))
                )
                await _until(stop, follower)
        finally:
            await server.stop()

    asyncio.run(main())


def _check_several(
    policies: list[str],
    model_spec: str | None,
    resource: str,
    served_model_name: str,
    engine: dict[str, Any],
) -> None:
    """--policy names each policy's resource and model: the one-policy options do not mix."""
    given = {"--resource": resource, "--served-model-name": served_model_name}
    for option, value in given.items():
        if value != "policy":
            raise click.UsageError(
                f"{option} and --policy do not mix: each --policy serves the resource of its "
                "name under its name"
            )
    if model_spec is not None:
        raise click.UsageError("--model and --policy do not mix: --policy follows published "
                               "versions of each policy")  # fmt: skip
    if engine["engine"] == "vllm" and engine["vllm_lora"] == "merge" and len(policies) > 1:
        raise click.UsageError(
            "--vllm-lora merge serves one policy: several policies share one vLLM as "
            "adapters (--vllm-lora adapter), or run a serve per policy"
        )


async def _load_fixed(server: PolicyServer, spec: str, seed: int, where: Placement) -> None:
    """--model: built (a tiny one) or read in this process for torch, a directory for vLLM."""
    from agl_stream.serving.engine import Loaded, TorchEngine
    from agl_stream.training.model import initial_policy

    try:
        if isinstance(server.engine, TorchEngine):
            policy = await asyncio.to_thread(initial_policy, spec, seed, where)
            server.load(Loaded(policy, f"model:{spec}"))
        else:
            checkpoint = await asyncio.to_thread(fixed_checkpoint, spec, seed)
            await server.engine.load(f"model:{spec}", checkpoint)
    except (ValueError, OSError) as exc:
        await server.engine.close()
        raise click.BadParameter(str(exc), param_hint="--model") from None


async def _follow(app: AppContext, server: PolicyServer, resource: str, pin: str | None) -> None:
    from agl_stream.bus.kafka import producer
    from agl_stream.commands.resources import ResourceCache, follow_resources
    from agl_stream.runtime.supervision import restarting

    cache = ResourceCache()
    kafka = app.kafka()
    async with producer(kafka) as prod:
        await asyncio.gather(
            # A follower that fails is logged and started again; the policy keeps serving.
            restarting(
                lambda: follow_resources(kafka, prod, cache, "policy-server"),
                "the resources follower",
            ),
            server.follow(cache, resource, pin),
        )


async def _until(stop: asyncio.Event, task: asyncio.Task[None] | None) -> None:
    """Until a signal; a background task that fails ends the command with its error."""
    waiter = asyncio.create_task(stop.wait())
    pending = {waiter} | ({task} if task else set())
    done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    for other in pending - done:
        other.cancel()
    await asyncio.gather(*(pending - done), return_exceptions=True)
    for finished in done:
        finished.result()


@click.command()
@click.option(
    "--upstream",
    required=True,
    metavar="URL",
    help="OpenAI-compatible base URL calls go to, e.g. http://localhost:8000/v1.",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8100, show_default=True)
@click.option(
    "--upstream-timeout",
    type=click.FloatRange(0.1),
    default=600.0,
    show_default=True,
    help="Seconds the upstream may stay silent before the call fails with a 504.",
)
@click.option(
    "--session-header",
    default="X-AGL-Session",
    show_default=True,
    help="Calls with this header are one session (rollout) per key, trained on.",
)
@click.option(
    "--session-prefix", default="session-", show_default=True, help="Rollout id = PREFIX + key."
)
@click.option(
    "--session-idle",
    type=click.FloatRange(0.1),
    default=300.0,
    show_default=True,
    help="Seconds without calls that end a session (X-AGL-Session-End: 1 ends it at once).",
)
@click.option(
    "--session-lost-after",
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds without a span after which a session whose gateway was killed is ended "
    "(unresponsive, with the reason) by any gateway of the deployment. [default: "
    "--session-idle + --upstream-timeout + 60]",
)
@click.option(
    "--session-mode",
    type=click.Choice(["train", "val", "test"]),
    default="train",
    show_default=True,
    help="The mode of session rollouts (train: the trainer learns from them).",
)
@click.option(
    "--reward-token",
    envvar="AGL_STREAM_REWARD_TOKEN",
    metavar="TOKEN",
    help="Bearer token of POST /rewards (off without one). [env: AGL_STREAM_REWARD_TOKEN]",
)
@click.pass_obj
@friendly_errors
def gateway(
    app: AppContext,
    /,
    upstream: str,
    host: str,
    port: int,
    upstream_timeout: float,
    session_header: str,
    session_prefix: str,
    session_idle: float,
    session_lost_after: float | None,
    session_mode: str,
    reward_token: str | None,
) -> None:
    """Run an OpenAI-compatible gateway in front of --upstream that records every call.

    Each runner runs a gateway of its own and hands each attempt a URL on it, so calls are
    recorded into their attempt. This one is for calls from outside runners: a call with a
    session key (--session-header) is recorded into that session's rollout, which ends at
    X-AGL-Session-End or when idle and is then trained on like any rollout; others are
    recorded under the rollout id `unattributed` (attempt: this process). POST /rewards
    takes rewards (with --reward-token).
    With AGL_STREAM_API_TOKEN set, calls need it as a bearer token (POST /rewards has its own);
    AGL_STREAM_UPSTREAM_TOKEN is the bearer token sent to the upstream (a `serve` that has a
    token of its own).
    """
    from agl_stream.bus.kafka import producer
    from agl_stream.bus.roles import group_for
    from agl_stream.bus.streams import EventPublisher, Topics
    from agl_stream.events import RolloutMode
    from agl_stream.gateway.proxy import Gateway
    from agl_stream.gateway.sessions import SessionConfig
    from agl_stream.otlp.closer import end_idle_attempts
    from agl_stream.otlp.idle import SESSIONS_LOST
    from agl_stream.runtime.supervision import restarting
    from agl_stream.telemetry.otlp import exporting

    base = _url(upstream)
    if not session_header.strip() or not session_header.isascii():
        raise click.BadParameter("give an ASCII header name", param_hint="--session-header")
    if reward_token is not None and len(reward_token) < 16:
        raise click.BadParameter(
            "a reward token needs 16 characters or more", param_hint="--reward-token"
        )
    lost_after = session_lost_after or session_idle + upstream_timeout + LOST_SESSION_MARGIN
    if lost_after <= session_idle:
        raise click.BadParameter(
            f"{lost_after:g} s would end live sessions: give more than --session-idle "
            f"({session_idle:g} s) and, better, more than it plus --upstream-timeout",
            param_hint="--session-lost-after",
        )
    sessions = SessionConfig(
        header=session_header, prefix=session_prefix, idle_seconds=session_idle,
        mode=RolloutMode(session_mode),
    )  # fmt: skip
    tokens = app.auth()

    async def main() -> None:
        stop = stop_on_signals()
        kafka = app.kafka()
        async with producer(kafka) as prod:
            proxy = Gateway(
                base, EventPublisher(prod, Topics(kafka)), upstream_timeout, sessions,
                reward_token, token=tokens.token, upstream_token=tokens.upstream,
            )  # fmt: skip
            with listening_on(f"{host}:{port}"):
                url = await proxy.start(host, port)
            console.print(f"gateway on {url}/v1 -> {base}", highlight=False)
            # Sessions of a gateway killed mid-session end once quiet for longer than a
            # gateway waits (idle, then a call's upstream timeout): unresponsive, with why.
            lost = restarting(
                lambda: end_idle_attempts(
                    kafka, lost_after,
                    group_for(kafka.topic_prefix, "gateway-sessions-lost"), stop,
                    proxy.counts, SESSIONS_LOST,
                ),
                "ending lost sessions",
            )  # fmt: skip
            ending = asyncio.create_task(lost)
            try:
                async with exporting(proxy.metrics, _worker_id("gateway")):
                    await stop.wait()
            finally:
                stop.set()
                await asyncio.gather(ending, return_exceptions=True)
                await proxy.stop()
                console.print(f"gateway stopped: {proxy.counts}", highlight=False)

    asyncio.run(main())
