"""The metrics component's typed config: which sinks a run writes besides metrics.jsonl, how often a table
of sample completions is logged, and how often a console without a terminal hears of progress."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class MetricsConfig(BaseModel):
    """metrics.jsonl is always written; TensorBoard and Weights & Biases only when asked (optional extra
    `inflight[metrics]`, imported only then)."""

    model_config = ConfigDict(extra="forbid")

    tensorboard: bool = False  # event files in RUN_DIR/tensorboard
    # W&B project name; None = no W&B. Online or offline as WANDB_MODE says; files under WANDB_DIR, else
    # RUN_DIR/wandb. A resumed run continues the same W&B run (its id is kept in RUN_DIR/wandb_run_id).
    wandb_project: str | None = None
    samples_every_steps: int = Field(default=10, ge=0)  # a (prompt, completion, reward) table; 0 = never
    samples_per_table: int = Field(default=4, ge=1)  # rollouts in each table, spread over the step's batch
    print_every_steps: int = Field(default=10, ge=1)  # no terminal: one progress line every this many steps

    @model_validator(mode="after")
    def _check(self) -> MetricsConfig:
        if self.wandb_project is not None and not self.wandb_project.strip():
            raise ValueError("metrics.wandb_project must be a W&B project name, or null for no W&B")
        return self
