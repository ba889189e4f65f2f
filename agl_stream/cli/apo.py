"""APO's options and its run (`worker trainer --algorithm apo`)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from agl_stream.cli.common import AppContext, PathType, console, stop_on_signals
from agl_stream.cli.resources import read_template
from agl_stream.commands.enqueue import EnqueueError, read_tasks


def apo_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """The options of APO, added to a click command."""
    options = [
        click.option("--prompt-name", default="prompt", show_default=True,
                     help="APO: the prompt template resource it improves."),
        click.option("--prompt", "seed_prompt", metavar="TEXT|@FILE",
                     help="APO: the template to start from. [default: the latest version's]"),
        click.option("--engine", type=click.Choice(["f_string", "jinja"]), default="f_string",
                     show_default=True, help="APO: the template engine of --prompt."),
        click.option("--train-tasks", type=PathType(dir_okay=False, path_type=Path),
                     help="APO: tasks (.jsonl, .json, .parquet) templates are critiqued on."),
        click.option("--val-tasks", type=PathType(dir_okay=False, path_type=Path),
                     help="APO: tasks templates are measured on (mean reward)."),
        click.option("--optimizer-endpoint", envvar="OPENAI_BASE_URL", metavar="URL",
                     help="APO: the OpenAI-compatible endpoint that critiques and rewrites. "
                          "[env: OPENAI_BASE_URL]"),
        click.option("--optimizer-model", default="gpt-4.1-mini", show_default=True,
                     help="APO: the model name sent to the optimizer endpoint."),
        click.option("--critique-model", metavar="NAME",
                     help="APO: the model name its critiques are asked of. "
                          "[default: --optimizer-model]"),
        click.option("--optimizer-max-tokens", type=click.IntRange(1), default=1024,
                     show_default=True, help="APO: most tokens of each critique or rewrite."),
        click.option("--rounds", type=click.IntRange(0), default=3, show_default=True,
                     help="APO: rounds of critique and rewrite after measuring the seed."),
        click.option("--beam-width", type=click.IntRange(1), default=2, show_default=True,
                     help="APO: templates kept (and branched from) each round."),
        click.option("--branch", type=click.IntRange(1), default=2, show_default=True,
                     help="APO: rewrites asked for per template and round."),
        click.option("--train-batch", type=click.IntRange(1), default=8, show_default=True,
                     help="APO: training tasks each template runs on before its critique."),
        click.option("--rollout-timeout", type=click.FloatRange(0, min_open=True),
                     help="APO: seconds each of its rollouts may run."),
    ]  # fmt: skip
    for option in reversed(options):
        func = option(func)
    return func


def _tasks(path: Path | None, flag: str) -> list[Any]:
    if path is None:
        raise click.UsageError(f"APO needs {flag} FILE")
    try:
        tasks = list(read_tasks(path))
    except (EnqueueError, OSError) as exc:
        raise click.BadParameter(str(exc), param_hint=flag) from None
    if not tasks:
        raise click.BadParameter(f"{path} holds no tasks", param_hint=flag)
    return tasks


def apo_config(options: dict[str, Any]) -> Any:
    from agl_stream.events import TemplateEngine
    from agl_stream.training.apo.optimizer import ApoConfig

    if not options.get("checkpoint_dir"):
        raise click.UsageError("APO needs --checkpoint-dir, where it keeps its state")
    if not options.get("optimizer_endpoint"):
        raise click.UsageError(
            "APO needs --optimizer-endpoint URL (or OPENAI_BASE_URL): an OpenAI-compatible "
            "endpoint that writes critiques and rewrites"
        )
    seed = options["seed_prompt"]
    if seed is not None:
        seed = read_template(seed, options["engine"], "--prompt").template
    return ApoConfig(
        state_dir=options["checkpoint_dir"],
        train_tasks=_tasks(options["train_tasks"], "--train-tasks") if options["rounds"] else [],
        val_tasks=_tasks(options["val_tasks"], "--val-tasks"),
        optimizer_endpoint=options["optimizer_endpoint"],
        optimizer_model=options["optimizer_model"], critique_model=options["critique_model"],
        prompt_name=options["prompt_name"], seed_template=seed,
        engine=TemplateEngine(options["engine"]), run_name=options["run_name"] or "apo",
        rounds=options["rounds"], beam_width=options["beam_width"], branch=options["branch"],
        train_batch=options["train_batch"], rollout_timeout=options["rollout_timeout"],
        seed=options["seed"], max_tokens=options["optimizer_max_tokens"],
        optimizer_api_key=os.environ.get("OPENAI_API_KEY", "not-needed"),
    )  # fmt: skip


def run_apo(
    app: AppContext, config: Any, metrics_host: str = "127.0.0.1", metrics_port: int = 0
) -> None:
    from agl_stream.telemetry.metrics import serving_metrics
    from agl_stream.telemetry.otlp import exporting
    from agl_stream.training.apo.optimizer import Apo, ApoError

    def show(report: Any) -> None:
        made = ", ".join(
            f"{c.cid} {'rejected' if c.rejected else f'{c.score:.3f}'}" for c in report.candidates
        )
        console.print(
            f"round {report.round}: best {report.best.cid} ({report.best.score:.3f})"
            + (f", published {report.published}" if report.published else "")
            + (f"; measured {made}" if made else ""),
            highlight=False,
        )

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, console=console, transient=True) as bars:
        shown: dict[str, TaskID] = {}

        def progress(what: str, finished: int, total: int) -> None:
            if what not in shown:
                for old in shown.values():
                    bars.remove_task(old)
                shown.clear()
                shown[what] = bars.add_task(what, total=total)
            bars.update(shown[what], completed=finished)

        apo = Apo(app.kafka(), app.database(), config, on_round=show, on_progress=progress)
        console.print(
            f"apo {config.worker_id}: state in {apo.path}", highlight=False, soft_wrap=True
        )

        async def main() -> Any:
            async with (
                serving_metrics(apo.metrics, metrics_host, metrics_port, app.auth().token),
                exporting(apo.metrics, config.worker_id),
            ):
                return await apo.run(stop_on_signals())

        try:
            state = asyncio.run(main())
        except ApoError as exc:
            raise click.ClickException(str(exc)) from None
    table = Table(title=f"APO run {state.run_id}", title_justify="left")
    for column in ("candidate", "round", "parent", "score", "status"):
        table.add_column(column, justify="right" if column in ("round", "score") else "left")
    for c in state.candidates.values():
        status = "best" if state.beam and c.cid == state.beam[0] else (
            "beam" if c.cid in state.beam else (f"rejected: {c.rejected}" if c.rejected else "")
        )  # fmt: skip
        score = "-" if c.score is None else f"{c.score:.3f}"
        table.add_row(c.cid, str(c.round), c.parent or "-", score, status)
    console.print(table)
    best = state.best()
    if best is not None:
        console.print(f"best template ({best.cid}):\n{best.template}", highlight=False)
