"""One JSONL line per step in the run directory (`metrics.jsonl`), plus the run's final summary."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import IO, Any

METRICS_FILE = "metrics.jsonl"


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf; write null so every reader (jq, pandas) accepts the file.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Appends `{"step": n, "time_s": ..., **metrics}` lines; safe to reopen on resume."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = self.path.open("a")
        self._t0 = time.time()

    def log(self, step: int, metrics: dict[str, Any], phase: str = "train") -> None:
        row = {"step": step, "phase": phase, "time_s": round(time.time() - self._t0, 3)}
        row.update({k: _clean(v) for k, v in metrics.items()})
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


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
