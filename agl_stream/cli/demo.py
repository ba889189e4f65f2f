"""`agl-stream demo`: the main job on the embedded stack, from nothing to a reward curve."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import click
from rich.table import Table

from agl_stream.cli.common import AppContext, PathType, console, friendly_errors, training_progress
from agl_stream.cli.stack import home_option
from agl_stream.embedded.process import free_port
from agl_stream.runtime.config import DatabaseSettings


@click.command("demo")
@home_option
@click.option(
    "--steps",
    type=click.IntRange(2),
    default=None,
    help="Training steps. [default: 30; with --model: 60]",
)
@click.option(
    "--task",
    type=click.Choice(["echo-letter", "two-agents"]),
    default="echo-letter",
    show_default=True,
    help="echo-letter: one policy learns to echo a letter. two-agents: two policies, a "
    "speaker and a listener with a trainer each, learn a referential game together.",
)
@click.option("--runners", type=click.IntRange(1, 16), default=2, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--max-staleness",
    type=click.IntRange(0, 1),
    default=0,
    show_default=True,
    help="1: queue each step's tasks one version early, so the runners sample while the "
    "trainer trains (its samples one update old, corrected by their logprobs).",
)
@click.option(
    "--out",
    "out_dir",
    type=PathType(file_okay=False, path_type=Path),
    default=Path(".agl-stream/demo"),
    show_default=True,
    help="Where checkpoints, worker logs and the reward curve go.",
)
@click.option(
    "--engine",
    type=click.Choice(["torch", "vllm"]),
    default="torch",
    show_default=True,
    help="The policy server's engine (vllm: vLLM's CPU build, on the tiny model with a head "
    "size its kernels take).",
)
@click.option(
    "--model",
    metavar="NAME",
    default=None,
    help="Train a real pretrained model instead of the tiny one: smollm2-135m-instruct (`make "
    "real-model` installs it) learns arithmetic word problems, served by vLLM and evaluated "
    "on a held-out set (the curve and a table at the end).",
)
@click.option(
    "--weights",
    type=click.Choice(["lora", "full"]),
    default="lora",
    show_default=True,
    help="With --model: train a LoRA adapter (merged into the base, the layers it adapts "
    "reloaded into vLLM in place) or the whole model (reloaded in place).",
)
@click.option(
    "--eval-every",
    type=click.IntRange(0),
    default=10,
    show_default=True,
    help="With --model: evaluate the held-out set every N steps (and before the first and "
    "after the last).",
)
@click.option("--keep-stack", is_flag=True, help="Leave the embedded stack running afterwards.")
@click.option(
    "--dashboard-port",
    type=click.IntRange(0, 65535),
    default=8765,
    show_default=True,
    help="Watch the run live in `agl-stream dashboard` on this port (0, or a port that is "
    "taken: any free one).",
)
@click.option("--no-dashboard", is_flag=True, help="Run without the dashboard.")
@click.pass_obj
@friendly_errors
def demo(
    app: AppContext,
    home: Path | None,
    steps: int | None,
    task: str,
    runners: int,
    seed: int,
    max_staleness: int,
    out_dir: Path,
    engine: str,
    model: str | None,
    weights: str,
    eval_every: int,
    keep_stack: bool,
    dashboard_port: int,
    no_dashboard: bool,
) -> None:
    """Train a tiny model from scratch on a small agent task, on this machine's CPU (or, with
    --model, a real pretrained model on word problems; with --task two-agents, two tiny
    models, a speaker and a listener, that learn a referential game together).

    Starts the embedded stack (if it is not running), a trainer, a projector and runners as
    separate processes; every policy version the trainer publishes gets a step of tasks
    pinned to it. Shows the mean reward of each step, prints a summary and writes the reward
    curve as a PNG.
    """
    if task == "two-agents":
        if model is not None or engine != "torch" or max_staleness:
            raise click.UsageError(
                "--task two-agents runs two tiny models in the runners: it takes neither "
                "--model, --engine nor --max-staleness"
            )
        from agl_stream.cli.demo_game import run_game_demo

        run_game_demo(
            app, home, steps=steps or 30, runners=runners, seed=seed, out_dir=out_dir,
            keep_stack=keep_stack,
        )  # fmt: skip
        return
    if model is not None:
        from agl_stream.cli.demo_real import run_real_demo

        run_real_demo(
            app, home, model=model, weights=weights, eval_every=eval_every, steps=steps or 60,
            runners=runners, seed=seed, out_dir=out_dir, keep_stack=keep_stack,
            dashboard_port=None if no_dashboard else _dashboard_port(dashboard_port),
        )  # fmt: skip
        return
    # Here, not at the top: the demo's agent needs torch (the `train` extra), and the CLI runs
    # in the image without it (EXTRAS=s3) too.
    from agl_stream.demo.curve import plot_rewards, summary_rows
    from agl_stream.demo.task import tasks
    from agl_stream.launch.run import RunConfig, RunFailed, StepPoint, run_training

    steps = steps or 30
    started = time.monotonic()
    from agl_stream.embedded.ready import ready_stack

    with console.status("starting the embedded stack..."):
        ready = ready_stack(home, app.topic_prefix)  # at the ports it was told, not the defaults
    kafka, database = ready.kafka, ready.database
    port = None if no_dashboard else _dashboard_port(dashboard_port)
    config = RunConfig(
        steps=steps, runners=runners, seed=seed, out_dir=out_dir, max_staleness=max_staleness,
        dashboard_port=port, engine=engine, task_source=tasks,
    )  # fmt: skip
    console.print(
        f"demo {config.run_name}: {runners} runners, a projector, a trainer, a policy server "
        f"({engine}); "
        f"{steps} steps of {config.groups_per_step} tasks x {config.group_size} attempts",
        highlight=False,
    )
    if port is not None:
        console.print(f"watch it live: http://127.0.0.1:{port}/", highlight=False)
    progress = training_progress("mean reward {task.fields[reward]}")
    try:
        with progress:
            bar = progress.add_task("steps", total=steps, reward="-")

            def on_step(point: StepPoint) -> None:
                progress.update(bar, completed=point.step, reward=f"{point.mean_reward:.3f}")

            try:
                points = run_training(config, kafka, database, on_step)
            except RunFailed as exc:
                raise click.ClickException(str(exc)) from None
        rollouts = asyncio.run(_rollout_counts(database))
    finally:
        if ready.started and not keep_stack:
            with console.status("stopping the embedded stack..."):
                ready.stack.down()
    png = plot_rewards(points, config.out_dir / config.run_name / "reward-curve.png", config)
    table = Table(title=f"demo {config.run_name}", show_header=False, title_justify="left")
    for name, value in summary_rows(points):
        table.add_row(name, value)
    table.add_row("rollouts in the read model (every run)", rollouts)
    table.add_row("checkpoints", str(config.checkpoint_dir))
    table.add_row("reward curve", str(png))
    table.add_row("wall time", f"{time.monotonic() - started:.0f} s")
    console.print(table)


def _dashboard_port(wanted: int) -> int:
    """The port asked for when it is free, else any free one (a dashboard already running
    on it, say, must not stop the demo)."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", wanted))
        except OSError:
            return free_port()
    return wanted or free_port()


async def _rollout_counts(database: DatabaseSettings) -> str:
    from agl_stream.queries import ReadModel

    async with ReadModel.open(database) as model:
        counts = await model.status_counts()
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "none"
