"""Where a run's metrics go besides metrics.jsonl: the abstract sink and the one place that opens the
configured ones (TensorBoard, Weights & Biases), importing each backend only when it is asked for."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inflight.metrics.config import MetricsConfig


@dataclass(frozen=True)
class SampleRow:
    """One row of a sample table: what a researcher reads to see what the policy does."""

    prompt: str  # decoded tokens before the first generated one
    completion: str  # decoded tokens from the first generated one on (environment turns included)
    reward: float


class MetricsSink(ABC):
    """A backend for scalars and sample tables. Calls come from one thread at a time (the loop's)."""

    @abstractmethod
    def log_scalars(self, step: int, phase: str, scalars: dict[str, float]) -> None:
        """`scalars` are finite numbers, keyed as in metrics.jsonl; `phase` is train, eval, summary, ..."""

    @abstractmethod
    def log_samples(self, step: int, rows: Sequence[SampleRow]) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


def open_sinks(config: MetricsConfig, run_dir: Path, run_config: dict[str, Any] | None) -> list[MetricsSink]:
    """The sinks `config` asks for; a missing package or a backend that cannot start is a UserError."""
    sinks: list[MetricsSink] = []
    if config.tensorboard:
        from inflight.metrics.tensorboard_sink import TensorBoardSink

        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    if config.wandb_project:
        from inflight.metrics.wandb_sink import WandbSink

        try:
            sinks.append(WandbSink(config.wandb_project, run_dir, run_config))
        except BaseException:
            for sink in sinks:  # what was opened before the failure
                sink.close()
            raise
    return sinks
