"""Weights & Biases sink: scalars as `PHASE/KEY` against a `step` axis, sample tables as wandb.Table under
`samples`. Online or offline as WANDB_MODE says; a resumed run directory continues its W&B run."""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from inflight.errors import UserError
from inflight.metrics.sink import MetricsSink, SampleRow

RUN_ID_FILE = "wandb_run_id"


class WandbSink(MetricsSink):
    def __init__(self, project: str, run_dir: Path, run_config: dict[str, Any] | None) -> None:
        try:
            import wandb
        except ImportError:
            raise UserError(
                f"metrics.wandb_project={project} needs the wandb package: pip install 'inflight[metrics]'"
            ) from None
        self._wandb = wandb
        # The id is kept in the run directory so that a resumed run appends to the same W&B run.
        id_path = run_dir / RUN_ID_FILE
        run_id = id_path.read_text().strip() if id_path.is_file() else uuid.uuid4().hex[:12]
        # WANDB_DIR, when set, wins; else W&B's files live with the run's other outputs.
        wandb_dir = None if os.environ.get("WANDB_DIR") else str(run_dir)
        try:
            self._run = wandb.init(
                project=project,
                name=run_dir.name,
                id=run_id,
                resume="allow",
                dir=wandb_dir,
                config=run_config or {},
            )
        except Exception as e:  # login, network, permissions: the run has not started, so say so in one line
            first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(
                f"metrics.wandb_project={project}: W&B could not start ({first_line}); run `wandb login`, "
                "or set WANDB_MODE=offline"
            ) from None
        id_path.write_text(run_id + "\n")
        # Steps are the run's optimizer steps, and eval/summary rows share them with train rows: a custom
        # step axis, since W&B's own _step must only grow.
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def log_scalars(self, step: int, phase: str, scalars: dict[str, float]) -> None:
        self._run.log({"step": step, **{f"{phase}/{key}": value for key, value in scalars.items()}})

    def log_samples(self, step: int, rows: Sequence[SampleRow]) -> None:
        table = self._wandb.Table(
            columns=["step", "prompt", "completion", "reward"],
            data=[[step, r.prompt, r.completion, r.reward] for r in rows],
        )
        self._run.log({"step": step, "samples": table})

    def close(self) -> None:
        self._run.finish()
