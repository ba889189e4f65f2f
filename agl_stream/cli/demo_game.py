"""`agl-stream demo --task two-agents`: a speaker and a listener, two tiny models with a
trainer each, learn the referential game together on the embedded stack; a progress bar per
step, a table with each policy's first and last tenth and the swap check, and a curve."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.table import Table

from agl_stream.cli.common import AppContext, console, training_progress

if TYPE_CHECKING:
    from agl_stream.demo.two_policies import JointStep, TwoPolicyConfig, TwoPolicyResult


def run_game_demo(
    app: AppContext,
    home: Path | None,
    *,
    steps: int,
    runners: int,
    seed: int,
    out_dir: Path,
    keep_stack: bool,
) -> None:
    from agl_stream.demo.two_policies import TwoPolicyConfig, run_two_policies
    from agl_stream.embedded.ready import ready_stack
    from agl_stream.launch.run import RunFailed

    started = time.monotonic()
    with console.status("starting the embedded stack..."):
        ready = ready_stack(home, app.topic_prefix)
    config = TwoPolicyConfig(steps=steps, runners=runners, seed=seed, out_dir=out_dir)
    console.print(
        f"demo {config.run_name}: two policies (speaker, listener) with a trainer each, "
        f"{runners} runners, a projector; {steps} steps of {config.groups_per_step} tasks x "
        f"{config.group_size} attempts",
        highlight=False,
    )
    progress = training_progress("joint reward {task.fields[reward]}")
    try:
        with progress:
            bar = progress.add_task("steps", total=steps, reward="-")

            def on_step(point: JointStep) -> None:
                progress.update(bar, completed=point.step, reward=f"{point.mean_reward:.3f}")

            try:
                result = run_two_policies(config, ready.kafka, ready.database, on_step)
            except RunFailed as exc:
                raise click.ClickException(str(exc)) from None
    finally:
        if ready.started and not keep_stack:
            with console.status("stopping the embedded stack..."):
                ready.stack.down()
    console.print(summary(config, result, time.monotonic() - started))


def summary(config: TwoPolicyConfig, result: TwoPolicyResult, seconds: float) -> Table:
    from agl_stream.demo.curve import plot_policies, tenths
    from agl_stream.demo.game import POLICIES

    curves = {p: result.points(p) for p in POLICIES}
    png = plot_policies(
        curves, config.out_dir / config.run_name / "reward-curve.png",
        f"agl-stream demo {config.run_name}: two policies learn a referential game",
        chance=0.2,
    )  # fmt: skip
    table = Table(title=f"demo {config.run_name}", show_header=False, title_justify="left")
    table.add_row("steps", str(len(result.steps)))
    for policy, points in curves.items():
        first, last = tenths(points)
        table.add_row(f"{policy}: mean reward, first / last tenth", f"{first:.3f} / {last:.3f}")
    for swap in result.swaps:
        table.add_row(
            f"joint reward, {swap.speaker} speaker + {swap.listener} listener "
            f"({config.swap_games} games)",
            f"{swap.reward:.3f}",
        )
    table.add_row("checkpoints", str(config.checkpoint_dir(POLICIES[0]).parent))
    table.add_row("reward curve", str(png))
    table.add_row("wall time", f"{seconds:.0f} s")
    return table
