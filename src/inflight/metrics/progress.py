"""A rich progress bar with the live reward; silent when stdout is not a terminal unless asked."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class StepProgress:
    def __init__(self, total_steps: int, description: str, enabled: bool = True) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]:>7}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            disable=not enabled,
        )
        self._task = self._progress.add_task(description, total=total_steps, reward="   -")

    def __enter__(self) -> StepProgress:
        self._progress.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._progress.stop()

    def update(self, step: int, reward: float | None) -> None:
        shown = f"{reward:+.3f}" if reward is not None else "   -"
        self._progress.update(self._task, completed=step, reward=shown)
