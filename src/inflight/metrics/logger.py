"""A run's metrics: one JSONL line per step and phase in the run directory (`metrics.jsonl`, always), sample
tables in `samples.jsonl`, and the same to TensorBoard and W&B when the MetricsConfig asks."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from inflight.metrics.config import MetricsConfig
from inflight.metrics.samples import sample_rows
from inflight.metrics.sink import MetricsSink, SampleRow, open_sinks
from inflight.types import Rollout

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf; write null so every reader (jq, pandas) accepts the file.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    # TensorBoard and W&B plot numbers; strings (a summary's run_dir) and missing values stay in the JSONL.
    return {
        key: float(value)
        for key, value in metrics.items()
        if isinstance(value, int | float) and math.isfinite(value)
    }


class MetricsLogger:
    """Appends `{"step": n, "phase": ..., "time_s": ..., **metrics}` lines; safe to reopen on resume.

    `run_config` (the run's whole config as a dict) is what W&B records as the run's config.
    """

    def __init__(
        self,
        run_dir: str | Path,
        config: MetricsConfig | None = None,
        run_config: dict[str, Any] | None = None,
    ) -> None:
        self.config = config or MetricsConfig()
        run_dir = Path(run_dir)
        self.path = run_dir / METRICS_FILE
        self.samples_path = run_dir / SAMPLES_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._sinks: list[MetricsSink] = open_sinks(self.config, run_dir, run_config)
        self._file: IO[str] = self.path.open("a")
        self._t0 = time.time()

    def log(self, step: int, metrics: dict[str, Any], phase: str = "train") -> None:
        row = {"step": step, "phase": phase, "time_s": round(time.time() - self._t0, 3)}
        row.update({k: _clean(v) for k, v in metrics.items()})
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        scalars = _scalars(metrics)
        for sink in self._sinks:
            sink.log_scalars(step, phase, scalars)

    def log_samples(self, step: int, rows: Sequence[SampleRow]) -> None:
        """A table of sample completions: one `samples.jsonl` line per row, a text table in TensorBoard, a
        wandb.Table in W&B."""
        with self.samples_path.open("a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **dataclasses.asdict(row)}) + "\n")
        for sink in self._sinks:
            sink.log_samples(step, rows)

    def log_rollout_samples(
        self, step: int, rollouts: Sequence[Rollout], decode: Callable[[list[int]], str]
    ) -> None:
        """Every `samples_every_steps` steps (0-based `step`; after steps N, 2N, ...), a table of
        `samples_per_table` of the step's rollouts. The loops call this every step."""
        every = self.config.samples_every_steps
        if every and (step + 1) % every == 0:
            self.log_samples(step, sample_rows(rollouts, decode, self.config.samples_per_table))

    def close(self) -> None:
        self._file.close()
        for sink in self._sinks:
            sink.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    from inflight.errors import UserError

    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise UserError(f"no {METRICS_FILE} in {run_dir}: is it a run directory?")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path} line {number} is not JSON ({e.msg}): fix or delete that line") from None
        if not isinstance(row, dict):
            raise UserError(f"{path} line {number} is not a JSON object: fix or delete that line")
        rows.append(row)
    return rows
