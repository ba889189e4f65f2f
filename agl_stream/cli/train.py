"""The trainer's options (shared by `worker trainer` and `retrain`), `retrain` and
`checkpoints`."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Callable
from datetime import datetime
from typing import Any

import click
from rich.table import Table

from agl_stream.cli.common import (
    AppContext,
    PathType,
    check_policies,
    console,
    friendly_errors,
    parse_offsets,
    stop_on_signals,
    torch_options,
)
from agl_stream.cli.times import TIME
from agl_stream.training.trajectories import TRAINED_TOPICS

ALGORITHMS = ("grpo", "apo")


def trainer_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """The options that configure a trainer, added to a click command."""
    options = [
        click.option("--algorithm", type=click.Choice(ALGORITHMS), default="grpo",
                     show_default=True, help="The training algorithm (trainer)."),
        click.option("--checkpoint-dir", metavar="PATH|file://URI|s3://BUCKET/PREFIX",
                     help="Where the trainer writes checkpoints and resumes from (s3://: an "
                     "S3-compatible store, boto3's AWS_* settings; pip install "
                     "'agl-stream[s3]')."),
        click.option("--init-model", default="tiny", show_default=True,
                     help="The policy of a fresh run: 'tiny' (random, CPU), a pretrained "
                          "model's short name (smollm2-135m-instruct), a .gguf file or a Hugging "
                          "Face folder."),
        click.option("--run-name",
                     help="Prefix of the resources ids the trainer publishes. "
                          "[default: the algorithm's name]"),
        click.option("--policy", "policies", multiple=True, metavar="NAME",
                     help="The policy trained: the LLM calls that name it (agl.llm.policy; "
                          "calls naming none are 'policy''s), the resource it publishes. "
                          "Repeated: one process trains each (checkpoints in "
                          "--checkpoint-dir/NAME, seeds --seed, --seed+1, ...). "
                          "[default: policy]"),
        click.option("--agent-match", metavar="REGEX",
                     help="Train only the calls made inside the spans of agents whose names "
                          "this regular expression matches (Agent Lightning's agent_match, "
                          "LitAgent(trained_agents=)). [default: every call of the policy]"),
        click.option("--group-size", type=click.IntRange(1), default=8, show_default=True,
                     help="Attempts of one task that make a GRPO group."),
        click.option("--groups-per-step", type=click.IntRange(1), default=8, show_default=True,
                     help="Full groups in one update."),
        click.option("--max-waiting", type=click.IntRange(1), default=10_000, show_default=True,
                     help="Most trajectories waiting for their group to fill; past it the "
                          "oldest groups that are not full are dropped (and counted)."),
        click.option("--reward-rule", type=click.Choice(["final", "per_call", "discounted"]),
                     default="final", show_default=True,
                     help="How an attempt's rewards become each LLM call's reward."),
        click.option("--late-reward", metavar="NAME",
                     help="Train on the reward NAME given after the attempt (`agl-stream "
                          "reward`, POST /rewards), waiting for it up to --late-reward-wait."),
        click.option("--late-reward-wait", type=click.FloatRange(0), default=60.0,
                     show_default=True,
                     help="Seconds of broker time after an attempt's end its late reward may "
                          "come in."),
        click.option("--late-reward-missing", type=click.Choice(["drop", "final"]),
                     default="drop", show_default=True,
                     help="When it did not come: drop the attempt, or use its final reward "
                          "(counted in the step's lineage either way)."),
        click.option("--max-staleness", type=click.IntRange(0), default=None,
                     help="Most updates of the trained policy a sample's checkpoint may be "
                          "behind (versions others publish do not count). [default: no bound]"),
        click.option("--stale-policy", type=click.Choice(["drop", "downweight"]), default="drop",
                     show_default=True, help="What happens to samples past --max-staleness."),
        click.option("--learning-rate", type=click.FloatRange(0, min_open=True), default=3e-3,
                     show_default=True),
        click.option("--epochs", type=click.IntRange(1), default=2, show_default=True,
                     help="Passes over each batch."),
        click.option("--entropy-coef", type=click.FloatRange(0, 1, max_open=True), default=0.0,
                     show_default=True,
                     help="A bonus for the entropy of the policy's next-token distributions "
                          "at response tokens, against collapsing onto one answer."),
        click.option("--temperature", type=click.FloatRange(0, min_open=True), default=1.0,
                     show_default=True,
                     help="The sampling temperature the agents use: the logprobs are "
                          "recomputed under it, as the sampler recorded them."),
        click.option("--max-steps", type=click.IntRange(1), default=None,
                     help="Stop after this many steps (counting those of resumed checkpoints)."),
        click.option("--start", type=click.Choice(["earliest", "latest"]), default="earliest",
                     show_default=True,
                     help="Where a fresh run starts reading (a resumed one goes on from "
                          "its checkpoint)."),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--minibatch-size", type=click.IntRange(1), default=32, show_default=True,
                     help="Samples in one optimiser step."),
        click.option("--micro-batch-tokens", type=click.IntRange(1), default=None,
                     help="Most padded tokens (rows x longest row) in one forward/backward "
                          "pass: a mini-batch runs as micro-batches under it, gradients "
                          "accumulated (the same update, less memory). [default: no split]"),
        click.option("--gradient-checkpointing/--no-gradient-checkpointing", default=False,
                     show_default=True,
                     help="Recompute activations in the backward pass (less memory, ~30% "
                          "more compute)."),
        click.option("--lora-rank", type=int, default=None,
                     help="Train a LoRA adapter of this rank on the frozen --init-model "
                          "instead of the whole model; versions publish the adapter only. "
                          "[default: whole model]"),
        click.option("--lora-alpha", type=float, default=None,
                     help="LoRA's scale numerator. [default: twice the rank]"),
        click.option("--lora-dropout", type=float, default=0.0, show_default=True),
        click.option("--lora-target-modules", default="all-linear", show_default=True,
                     metavar="NAME,...",
                     help="Modules the adapter wraps (e.g. q_proj,v_proj); all-linear: "
                          "every linear layer but the output head."),
        click.option("--lora-config", type=PathType(exists=True, dir_okay=False),
                     help="A peft LoraConfig as JSON (adapter_config.json's keys), instead "
                          "of the --lora-* options."),
        click.option("--keep", type=click.IntRange(1), default=None,
                     help="Keep the last N checkpoints and every one a live version names "
                          "(the latest, or one a queued or running rollout names); delete "
                          "the rest. [default: keep all]"),
    ]  # fmt: skip
    for option in reversed(options):
        func = option(func)
    return torch_options(func)


def _lora(options: dict[str, Any]) -> Any:
    """LoraSettings from the --lora-* options, or None for a whole-model run."""
    from pathlib import Path

    from agl_stream.training.lora import LoraSettings

    config_file = options["lora_config"]
    if options["lora_rank"] is None and config_file is None:
        return None
    targets = tuple(t.strip() for t in options["lora_target_modules"].split(",") if t.strip())
    return LoraSettings(
        rank=8 if options["lora_rank"] is None else options["lora_rank"],
        alpha=options["lora_alpha"], dropout=options["lora_dropout"], target_modules=targets,
        config_file=Path(config_file) if config_file else None,
    )  # fmt: skip


def trainer_config(checkpoint_dir: str | None, **options: Any) -> Any:
    """TrainerConfig from the options (imports torch: only when a trainer runs)."""
    from agl_stream.training.batching import Staleness, StalePolicy
    from agl_stream.training.checkpoints import checkpoint_root
    from agl_stream.training.device import placement
    from agl_stream.training.grpo import GRPOConfig
    from agl_stream.training.trainer import TrainerConfig
    from agl_stream.training.trajectories import LateRewardRule, MissingLateReward
    from agl_stream.training.triplets import RewardRule

    if not checkpoint_dir:
        raise click.UsageError("a trainer needs --checkpoint-dir, where its checkpoints live")
    policies = check_policies(options.get("policies") or ("policy",))
    agent_match = options.get("agent_match")
    if agent_match is not None:
        try:
            re.compile(agent_match)
        except re.error as exc:
            raise click.UsageError(f"--agent-match {agent_match!r}: {exc}") from None
    try:
        checkpoint_root(checkpoint_dir)
        staleness = Staleness(options["max_staleness"], StalePolicy(options["stale_policy"]))
        if options["max_waiting"] < options["group_size"] * options["groups_per_step"]:
            raise ValueError(
                f"--max-waiting {options['max_waiting']} cannot hold one step: "
                f"--groups-per-step {options['groups_per_step']} x --group-size "
                f"{options['group_size']} trajectories"
            )
        grpo = GRPOConfig(
            learning_rate=options["learning_rate"], epochs=options["epochs"], seed=options["seed"],
            entropy_coef=options.get("entropy_coef", 0.0),
            temperature=options["temperature"],
            minibatch_size=options["minibatch_size"],
            micro_batch_tokens=options["micro_batch_tokens"],
            gradient_checkpointing=options["gradient_checkpointing"],
        )  # fmt: skip
        lora = _lora(options)
        late = None
        if options.get("late_reward") is not None:
            late = LateRewardRule(
                options["late_reward"], options["late_reward_wait"],
                MissingLateReward(options["late_reward_missing"]),
            )  # fmt: skip
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    where = placement(options["device"], options["dtype"], options["threads"], training=True)
    if where.dtype == "float16" and lora is None:
        raise click.UsageError(
            "--dtype float16 trains the whole model without loss scaling, which underflows: "
            "use bfloat16 or float32 (float16 suits a frozen LoRA base)"
        )
    return TrainerConfig(
        checkpoint_dir=checkpoint_dir, init_model=options["init_model"],
        run_name=options["run_name"] or "grpo", policy=policies[0], agent_match=agent_match,
        group_size=options["group_size"],
        groups_per_step=options["groups_per_step"], reward_rule=RewardRule(options["reward_rule"]),
        staleness=staleness, grpo=grpo, max_steps=options["max_steps"],
        max_waiting=options["max_waiting"],
        start_latest=options["start"] == "latest", placement=where, threads=where.threads or 1,
        lora=lora, keep=options["keep"], late_reward=late,
    )  # fmt: skip


def each_policy(config: Any, policies: tuple[str, ...]) -> list[Any]:
    """The config of each policy one trainer process trains: one policy, as given; several,
    each with its checkpoints in <checkpoint_dir>/<policy>, its seed (--seed, --seed + 1,
    ...) and a worker id of its own."""
    if len(policies) < 2:
        return [config]
    base = config.checkpoint_dir.rstrip("/")
    configs = []
    for i, policy in enumerate(policies):
        grpo = dataclasses.replace(config.grpo, seed=config.grpo.seed + i)
        directory, worker = f"{base}/{policy}", f"{config.worker_id}-{policy}"
        configs.append(
            dataclasses.replace(
                config, policy=policy, checkpoint_dir=directory, grpo=grpo, worker_id=worker
            )
        )
    return configs


def run_trainer(
    app: AppContext, configs: list[Any], metrics_host: str = "127.0.0.1", metrics_port: int = 0
) -> None:
    """Run a trainer for each config (several policies: all in this process, each with its
    own consumer group, checkpoints and versions; metrics on metrics_port, metrics_port + 1,
    ...) until a signal stops them; one that fails stops them all."""
    from agl_stream.telemetry.metrics import serving_metrics
    from agl_stream.telemetry.otlp import exporting
    from agl_stream.training.trainer import Trainer

    several = len(configs) > 1

    def show(config: Any) -> Callable[[Any], None]:
        def line(report: Any) -> None:
            console.print(
                (f"{config.policy} " if several else "")
                + f"step {report.step}: mean reward {report.mean_reward:.3f}, "
                f"{report.counts.get('samples', 0)} samples, "
                + (f"published {report.resources_id}" if config.publish else "checkpoint written"),
                highlight=False,
            )

        return line

    trainers = [Trainer(app.kafka(), c, on_step=show(c)) for c in configs]
    for trainer in trainers:
        config = trainer.config
        adapter = f", LoRA rank {config.lora.rank}" if config.lora is not None else ""
        console.print(
            f"trainer {config.worker_id}: "
            + (f"policy {config.policy}, " if several else "")
            + f"checkpoints in {trainer.store.root} ({config.placement.describe()}{adapter})",
            highlight=False,
        )

    async def serve(trainer: Any, port: int, stop: asyncio.Event) -> None:
        async with (
            serving_metrics(trainer.metrics, metrics_host, port, app.auth().token),
            exporting(trainer.metrics, trainer.config.worker_id),
        ):
            await trainer.run(stop)

    async def main() -> None:
        stop = stop_on_signals()
        ports = [metrics_port + i if metrics_port else 0 for i in range(len(trainers))]
        async with asyncio.TaskGroup() as group:
            for trainer, port in zip(trainers, ports, strict=True):
                group.create_task(serve(trainer, port, stop))

    try:
        asyncio.run(main())
    except BaseExceptionGroup as failed:  # the first trainer's failure, as one trainer's
        raise failed.exceptions[0] from None
    for trainer in trainers:
        console.print(
            f"trainer {trainer.config.policy if several else ''}".rstrip()
            + f" stopped at step {trainer.step}: {dict(trainer.counts)}",
            highlight=False,
        )


def _offsets(app: AppContext, values: tuple[str, ...], flag: str) -> dict[tuple[str, int], int]:
    prefix = app.kafka().topic_prefix
    return parse_offsets(values, flag, prefix, TRAINED_TOPICS, "a trainer")


@click.command("retrain")
@trainer_options
@click.option(
    "--from-offset",
    multiple=True,
    metavar="TOPIC:PARTITION=OFFSET",
    help="Start that partition here (default: its beginning). Repeatable.",
)
@click.option(
    "--until-offset",
    multiple=True,
    metavar="TOPIC:PARTITION=OFFSET",
    help="Stop that partition before this offset (default: its end now). Repeatable.",
)
@click.option("--from-time", type=TIME, help="Start at records written at or after this time.")
@click.option("--until-time", type=TIME, help="Stop at records written after this time.")
@click.pass_obj
@friendly_errors
def retrain_command(
    app: AppContext,
    /,
    from_offset: tuple[str, ...],
    until_offset: tuple[str, ...],
    from_time: datetime | None,
    until_time: datetime | None,
    **options: Any,
) -> None:
    """Train a fresh policy offline on a range of the topics.

    Replays the tasks, rollouts and spans topics from --from-offset/--from-time to
    --until-offset/--until-time (default: everything there now) into a new trainer that
    writes checkpoints to --checkpoint-dir and publishes nothing.
    """
    from agl_stream.training.checkpoints import CheckpointStore
    from agl_stream.training.retrain import resolve_range

    if options["algorithm"] != "grpo":
        raise click.UsageError(
            f"retrain trains a policy offline with GRPO; {options['algorithm']} runs online only"
        )
    if options["max_staleness"] is not None:
        # Its samples ran on the online trainer's versions, none of which is a step of the
        # fresh policy it trains: under a bound every one would be judged too stale.
        raise click.UsageError(
            "--max-staleness does not apply to retrain: the recorded attempts ran on another "
            "trainer's versions, not on the steps of the policy it trains (leave it out)"
        )
    config = trainer_config(**options)
    if CheckpointStore(config.checkpoint_dir).steps():
        raise click.UsageError(
            f"{options['checkpoint_dir']} already holds checkpoints: retrain into a new directory"
        )
    starts = _offsets(app, from_offset, "--from-offset")
    ends = _offsets(app, until_offset, "--until-offset")
    try:
        start, until = asyncio.run(resolve_range(app.kafka(), starts, ends))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    config.publish = False
    config.start = start
    config.until = until
    config.from_time = from_time
    config.until_time = until_time
    run_trainer(app, each_policy(config, options.get("policies") or ()))


@click.command("checkpoints")
@click.option("--checkpoint-dir", required=True, metavar="PATH|file://URI|s3://BUCKET/PREFIX")
@click.option(
    "--policy",
    metavar="NAME",
    help="The policy whose checkpoints to read: in --checkpoint-dir/NAME where one trainer "
    "process trained several, else in --checkpoint-dir (checked to be NAME's).",
)
@click.option("--json", "as_json", is_flag=True, help="Print trainer.json of every step.")
@friendly_errors
def checkpoints_command(checkpoint_dir: str, policy: str | None, as_json: bool) -> None:
    """A trainer's checkpoints: step, version, reward, samples and the offsets each consumed;
    says whether every consumed offset range was trained on exactly once."""
    import json

    from agl_stream.agent.llm import DEFAULT_POLICY
    from agl_stream.training.checkpoints import CheckpointStore, lineage_problems

    store = CheckpointStore(checkpoint_dir)
    if policy is not None:
        check_policies([policy])
        own = CheckpointStore(f"{checkpoint_dir.rstrip('/')}/{policy}")
        store = own if own.steps() else store
    states = store.lineage()
    if not states:
        held = [] if store.remote else sorted(
            d.name for d in store.root.glob("*") if d.is_dir() and CheckpointStore(str(d)).steps()
        )  # fmt: skip
        if policy is None and held:
            raise click.UsageError(
                f"no checkpoints in {store.root}; it holds the checkpoints of several "
                f"policies ({', '.join(held)}): name one with --policy"
            )
        raise click.UsageError(f"no checkpoints in {store.root}" + (
            f" or in {store.root}/{policy}" if policy else ""))  # fmt: skip
    others = {state.get("policy", DEFAULT_POLICY) for state in states} - {policy}
    if policy is not None and others:
        raise click.UsageError(
            f"{store.root} holds the checkpoints of policy {', '.join(sorted(others))}, "
            f"not {policy!r}"
        )
    if as_json:
        click.echo(json.dumps(states, indent=1))
        return
    of = f" (policy {policy})" if policy else ""
    table = Table(title=f"checkpoints in {store.root}{of}", title_justify="left")
    for column in ("step", "version", "resources id", "mean reward", "samples", "records consumed"):
        table.add_column(column, justify="left" if column == "resources id" else "right")
    for state in states:
        consumed = sum(end - start for start, end in state.get("consumed", {}).values())
        reward = state.get("mean_reward")
        table.add_row(
            str(state["step"]), str(state["version"]), state["resources_id"],
            "-" if reward is None else f"{reward:.3f}",
            str(state.get("counts", {}).get("samples", 0)), str(consumed),
        )  # fmt: skip
    console.print(table)
    problems = lineage_problems(states)
    if problems:
        for problem in problems:
            console.print(f"[red]lineage:[/] {problem}")
        raise SystemExit(1)
    steps = [state["step"] for state in states]
    pruned = sorted(set(range(steps[0], steps[-1] + 1)) - set(steps))
    console.print(
        "lineage: every consumed offset range once, no attempt trained on twice"
        + (f" (of the steps kept; pruned: {len(pruned)} between)" if pruned else ""),
        highlight=False,
    )
