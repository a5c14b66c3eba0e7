"""TensorBoard sink: scalars as `PHASE/KEY` (train/reward_mean, eval/return), sample tables as markdown text
under `samples`. Event files in RUN_DIR/tensorboard; `tensorboard --logdir runs` shows every run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from inflight.errors import UserError
from inflight.metrics.sink import MetricsSink, SampleRow


class TensorBoardSink(MetricsSink):
    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError(
                "metrics.tensorboard=true needs the tensorboard package: pip install 'inflight[metrics]'"
            ) from None
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log_scalars(self, step: int, phase: str, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(f"{phase}/{key}", value, step)
        # Flushed every step so that a live TensorBoard (and a crash) sees everything logged so far.
        self._writer.flush()

    def log_samples(self, step: int, rows: Sequence[SampleRow]) -> None:
        self._writer.add_text("samples", markdown_table(rows), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def markdown_table(rows: Sequence[SampleRow]) -> str:
    """TensorBoard renders text as markdown: one table row per sample, cells escaped to stay one cell."""

    def cell(text: str) -> str:
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")

    lines = ["| prompt | completion | reward |", "| --- | --- | ---: |"]
    lines += [f"| {cell(r.prompt)} | {cell(r.completion)} | {r.reward:+.4g} |" for r in rows]
    return "\n".join(lines)
