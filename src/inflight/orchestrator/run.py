"""One entry point for recipes: the sync loop or the asynchronous pipeline, by `cfg.mode`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from inflight.config import RunConfig
from inflight.metrics.logger import MetricsLogger
from inflight.orchestrator.sync_loop import LoopParts, prompt_seeds
from inflight.orchestrator.sync_loop import train as train_sync


def train(
    parts: LoopParts,
    cfg: RunConfig,
    logger: MetricsLogger,
    run_dir: str | Path,
    evaluate: Callable[[], dict[str, float]] | None = None,
) -> list[dict[str, float]]:
    """Train an Env-based recipe; `evaluate()` uses `parts.engine` (valid in both modes)."""
    if cfg.mode == "sync":
        return train_sync(parts, cfg, logger, str(run_dir), evaluate)
    from inflight.orchestrator.pipeline import PipelineParts, run_pipeline
    from inflight.rollouts.env_task import EnvTask

    task = EnvTask(
        parts.make_env, cfg.grpo.prompts_per_step, lambda s: prompt_seeds(cfg, s), cfg.grpo.max_turns
    )
    engine = parts.engine

    def evaluate_during(loop_engine: Any) -> dict[str, float]:
        # While the pipeline runs, the engine belongs to its loop thread: evaluate through the loop.
        assert evaluate is not None
        parts.engine = loop_engine
        try:
            return evaluate()
        finally:
            parts.engine = engine

    return run_pipeline(
        PipelineParts(engine, parts.trainer, parts.chat, task),
        cfg,
        logger,
        run_dir,
        evaluate_during if evaluate else None,
    )
