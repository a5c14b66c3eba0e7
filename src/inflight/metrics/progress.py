"""Progress on the console: a rich bar with the live reward on a terminal; without one (a log file, CI, a
pipe), a plain line every N steps, since a bar is only drawn when it stops and such a run looked dead."""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class StepProgress:
    """`update(step, reward)` after each step (`step` counts steps done). `terminal` None = ask the stream.
    `unit` names what is counted in the plain lines ("step"; an evaluation counts "episode"s)."""

    def __init__(
        self,
        total_steps: int,
        description: str,
        enabled: bool = True,
        every_steps: int = 10,
        stream: TextIO | None = None,
        terminal: bool | None = None,
        unit: str = "step",
    ) -> None:
        self.unit = unit
        self.total_steps, self.description, self.every_steps = total_steps, description, max(1, every_steps)
        self._stream = stream
        console = Console(file=stream, stderr=stream is None)
        self._bar = enabled and (console.is_terminal if terminal is None else terminal)
        self._plain = enabled and not self._bar
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]:>7}"),
            TimeElapsedColumn(),
            console=console,
            disable=not self._bar,
        )
        self._task = self._progress.add_task(description, total=total_steps, reward="   -")
        self._t0 = time.monotonic()
        self._first_step: int | None = None  # the first step this process ran (a resumed run starts late)

    def __enter__(self) -> StepProgress:
        self._progress.start()
        self._t0 = time.monotonic()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._progress.stop()

    def update(self, step: int, reward: float | None) -> None:
        shown = f"{reward:+.3f}" if reward is not None else "   -"
        self._progress.update(self._task, completed=step, reward=shown)
        if self._first_step is None:
            self._first_step = step - 1
        # The first step says the run is alive; then every N steps, and the last one.
        if self._plain and (
            step == self._first_step + 1 or step % self.every_steps == 0 or step == self.total_steps
        ):
            print(self.plain_line(step, shown), file=self._stream or sys.stderr, flush=True)

    def plain_line(self, step: int, reward: str) -> str:
        elapsed = time.monotonic() - self._t0
        done = step - (self._first_step or 0)
        per_step = f"{elapsed / done:.2f} s/{self.unit}" if done > 0 else f"- s/{self.unit}"
        minutes, seconds = divmod(int(elapsed), 60)
        return (
            f"{self.description}: {self.unit} {step}/{self.total_steps}  reward {reward.strip()}  "
            f"{per_step}  elapsed {minutes // 60}:{minutes % 60:02d}:{seconds:02d}"
        )
