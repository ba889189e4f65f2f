"""The one progress display of Trainer.fit and dev: a bar of steps (or rollouts) with the
latest figure beside it, on standard error so a script's own output stays clean."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class Display:
    def __init__(self, title: str, total: int, unit: str) -> None:
        self._progress = Progress(
            TextColumn(f"[bold]{title}"), TextColumn("{task.fields[unit]}"), BarColumn(),
            MofNCompleteColumn(), TextColumn("{task.fields[figure]}"), TimeElapsedColumn(),
            console=Console(stderr=True),
        )  # fmt: skip
        self._task = self._progress.add_task(unit, total=total, unit=unit, figure="")

    def start(self, total: int, unit: str) -> None:
        """A new phase (validation after training): a bar of its own."""
        self._task = self._progress.add_task(unit, total=total, unit=unit, figure="")

    def update(self, done: int, figure: str | None = None) -> None:
        if figure is None:
            self._progress.update(self._task, completed=done)
        else:
            self._progress.update(self._task, completed=done, figure=figure)

    def __enter__(self) -> Display:
        self._progress.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._progress.stop()
