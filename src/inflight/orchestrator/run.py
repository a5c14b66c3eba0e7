"""`run(cfg, task)`: one training run of any Task, in either mode, started fresh or resumed.

The phases, in order: check the task (its splits, its Env, its warm-up) before anything is written; the run
directory; the policy; the warm-up (if cfg.warmup.sft_steps); evaluation on the test split; cfg.grpo.steps
of GRPO (the sync loop or the pipeline, by cfg.mode; both continue a checkpoint found in the run
directory); evaluation again; checkpoint; summary. Owns the run directory's files (config.json,
metrics.jsonl, checkpoint/, summary.json, curves.png) and the summary keys every task shares; a run that
fails before its first step leaves no run directory behind. Knows nothing of any one task.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inflight.config import RunConfig
from inflight.envs.base import Environment
from inflight.errors import UserError, describe
from inflight.metrics.logger import METRICS_FILE, MetricsLogger
from inflight.metrics.plot import plot_run
from inflight.orchestrator.drivers import Driver, InlineDriver
from inflight.orchestrator.evaluate import evaluate
from inflight.orchestrator.publish import policy_engine, publish
from inflight.orchestrator.rollout_group import GroupPlayer
from inflight.orchestrator.setup import (
    build_engine,
    build_loop_trainer,
    load_policy,
    make_run_dir,
    pad_id,
    run_dir_path,
)
from inflight.orchestrator.stopping import StopRequest
from inflight.orchestrator.sync_loop import LoopParts
from inflight.orchestrator.sync_loop import train as train_sync
from inflight.orchestrator.task import Task, load_split
from inflight.orchestrator.task_warmup import task_warmup
from inflight.orchestrator.warmup import format_warmup
from inflight.rollouts.chat import ChatFormat
from inflight.trainer.checkpoint import checkpoint_step
from inflight.trainer.process import StepTrainer, TrainerProcess

if TYPE_CHECKING:
    import torch


def train(
    parts: LoopParts,
    cfg: RunConfig,
    logger: MetricsLogger,
    run_dir: str | Path,
    evaluate: Callable[[Driver], dict[str, float]] | None = None,
    launcher_metrics: Callable[[], dict[str, float]] | None = None,
    players: GroupPlayer | None = None,
) -> list[dict[str, float]]:
    """cfg.grpo.steps of GRPO by the sync loop or the pipeline (cfg.mode); returns this call's metrics.
    `players` (the pipeline's only): rollout workers elsewhere that play its groups."""
    if cfg.mode == "sync":
        if players is not None:
            raise UserError("rollout workers of their own (ray.num_rollout_workers) need mode=async")
        return train_sync(parts, cfg, logger, str(run_dir), evaluate)
    from inflight.orchestrator.pipeline import run_pipeline

    return run_pipeline(parts, cfg, logger, run_dir, evaluate, launcher_metrics, players)


def run(
    cfg: RunConfig,
    task: Task,
    launcher_metrics: Callable[[], dict[str, float]] | None = None,
    make_trainer: Callable[[RunConfig, torch.nn.Module, object], StepTrainer] | None = None,
    players: GroupPlayer | None = None,
    stop: StopRequest | None = None,
) -> dict[str, Any]:
    """Train `task` as `cfg` says; returns the summary (also in RUN_DIR/summary.json).

    This is the whole run in this process; `launch/ray.py` calls it inside the trainer's actor, with
    `pipeline.engine_urls` naming the replicas it placed, `launcher_metrics` counting their restarts
    (logged with every pipeline step) and `make_trainer` building the trainer over the warmed-up model
    (there: data-parallel ranks in actors of their own; by default `build_loop_trainer`) and `players`
    playing the pipeline's groups (there: rollout workers in actors of their own; by default the
    pipeline's event loop). `stop`, once set (a signal: `stopping.py`), ends the training after the step
    in flight; the run then checkpoints, evaluates and summarizes as usual, `stopped` naming the signal."""
    t0 = time.perf_counter()
    train_problems = load_split(task, "train")
    test_problems = load_split(task, "test") if cfg.eval.num_episodes else []
    check_task(cfg, task)
    with _run_directory(cfg) as run_dir:
        # Before any weights load: a damaged checkpoint fails now, in one line.
        first_step = checkpoint_step(run_dir / "checkpoint")
        # Closed however the run ends: a W&B run is finished, TensorBoard flushed.
        with contextlib.ExitStack() as stack:
            logger = stack.enter_context(
                contextlib.closing(MetricsLogger(run_dir, cfg.metrics, cfg.model_dump()))
            )
            model, tokenizer = load_policy(cfg)
            chat = ChatFormat.for_model(tokenizer, model)
            # Also when resuming: the warm-up is deterministic, and the KL reference is the warmed-up model.
            if cfg.warmup.sft_steps and task.env is not None:

                def new_env() -> Environment:
                    return task.make_env(cfg, "train")

                format_warmup(model, pad_id(tokenizer), chat, new_env, cfg, logger, task.warmup_reply)
            elif cfg.warmup.sft_steps:
                task_warmup(model, pad_id(tokenizer), task, train_problems, chat, cfg, logger)
            # The engine first: it copies the weights, and a LoRA trainer then wraps the model's layers.
            engine = build_engine(cfg, model, tokenizer)
            # The pipeline's may be a process of its own; a launcher's, ranks elsewhere.
            trainer = (make_trainer or build_loop_trainer)(cfg, model, tokenizer)
            if isinstance(trainer, TrainerProcess):
                stack.callback(trainer.close)
            parts = LoopParts(policy_engine(engine, trainer), trainer, chat, task, train_problems, stop)

            def test(driver: Driver, num_problems: int) -> dict[str, float]:
                return evaluate(task, test_problems, cfg, chat, driver, num_problems)

            def during(driver: Driver) -> dict[str, float]:
                return _test_metrics(test(driver, cfg.eval.num_episodes_during))

            initial = test(InlineDriver(parts.engine), cfg.eval.num_episodes)
            if initial:
                logger.log(0, _test_metrics(initial), phase="eval")
            evaluate_during = during if test_problems else None
            history = train(parts, cfg, logger, run_dir, evaluate_during, launcher_metrics, players)
            last_step = first_step + len(history)
            # Before the final evaluation, so that a second Ctrl-C during it keeps this step for a resume.
            if cfg.mode == "sync":  # the pipeline writes its own (with stream offsets and buffered groups)
                trainer.save_checkpoint(run_dir / "checkpoint", extra={"step": last_step})
            # The trained weights, whichever engine (or inference replica) generated with them.
            publish(parts.engine, trainer)
            final = test(InlineDriver(parts.engine), cfg.eval.num_episodes)
            if final:
                logger.log(last_step, _test_metrics(final), phase="eval")

            # A signal that came after the last step (during the final evaluation) stopped nothing.
            stopped = stop.reason if stop is not None and last_step < cfg.grpo.steps else None
            summary = build_summary(
                cfg, task, run_dir, t0, first_step, history, len(test_problems), initial, final, stopped
            )
            logger.log(last_step, summary, phase="summary")
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        plot_run(run_dir)
    return summary


def check_task(cfg: RunConfig, task: Task) -> None:
    """What can be wrong with a task under this config, found before the run directory exists."""
    if task.env is None:
        if cfg.env.name:
            raise UserError(
                f"env.name={cfg.env.name!r}: {task.name} is written with generate_rollout and plays no Env; "
                "unset env.name"
            )
        if cfg.warmup.sft_steps and task.warmup_reply is None:
            raise UserError(
                f"warmup.sft_steps={cfg.warmup.sft_steps} needs a `warmup_reply(transcript, rng) -> str` in "
                f"{task.name} (the scripted replies of its warm-up); or set warmup.sft_steps=0"
            )
        return
    # One environment, built and closed: a factory's bad arguments or return value show here, in one line.
    try:
        env = task.make_env(cfg, "train")
    except UserError:
        raise
    except Exception as e:
        raise UserError(
            f"{task.name}: building its environment with env.kwargs={cfg.env.kwargs} failed: {describe(e)}"
        ) from None
    if not (callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
        raise UserError(
            f"{task.name}: its Env factory returned a {type(env).__name__}, not an environment with "
            "reset() and step() (an inflight.envs.Environment)"
        )
    env.close()


@contextmanager
def _run_directory(cfg: RunConfig) -> Iterator[Path]:
    """The run directory, created here; removed again if this run made it and fails before its first step
    (a resumed run's directory is never removed)."""
    path = run_dir_path(cfg)
    fresh = not path.exists() or (path.is_dir() and not any(path.iterdir()))
    run_dir = make_run_dir(cfg, path)
    try:
        yield run_dir
    except BaseException:
        if fresh and not _trained_a_step(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def _trained_a_step(run_dir: Path) -> bool:
    try:
        return '"phase": "train"' in (run_dir / METRICS_FILE).read_text()  # the logger's json.dumps
    except OSError:
        return False


def _test_metrics(metrics: dict[str, float]) -> dict[str, float]:
    return {f"test/{key}": value for key, value in metrics.items()}


def build_summary(
    cfg: RunConfig,
    task: Task,
    run_dir: Path,
    t0: float,
    first_step: int,
    history: list[dict[str, float]],
    test_problems: int,
    initial: dict[str, float],
    final: dict[str, float],
    stopped: str | None = None,
) -> dict[str, Any]:
    """The keys every task reports, in this order: recipe, mode, steps (the whole run's, those before a
    resume included), wall_s, eval_problems and eval_problems_sampled (how many test problems the greedy
    and the sampled evaluation played), return_initial/final (greedy decoding on the test problems),
    return_initial/final_sampled (the sampling policy), the task's `summarize()` keys, return_first10/last10
    (mean training reward of the first and last tenth of the steps this process ran), stopped (the signal
    that ended the training before cfg.grpo.steps, else None), run_dir."""
    rewards = [h["reward_mean"] for h in history]
    evaluated, sampled_cap = min(cfg.eval.num_episodes, test_problems), cfg.eval.num_episodes_sampled
    tenth = max(1, len(rewards) // 10)
    extra = task.summarize(cfg, initial, final) if task.summarize and initial and final else {}
    return {
        "recipe": cfg.recipe,
        "mode": cfg.mode,
        "steps": first_step + len(history),
        "wall_s": round(time.perf_counter() - t0, 1),
        "eval_problems": evaluated,
        "eval_problems_sampled": evaluated if sampled_cap is None else min(sampled_cap, evaluated),
        "return_initial": _rounded(initial.get("return_greedy")),
        "return_final": _rounded(final.get("return_greedy")),
        "return_initial_sampled": _rounded(initial.get("return")),
        "return_final_sampled": _rounded(final.get("return")),
        **extra,
        "return_first10": round(statistics.fmean(rewards[:tenth]), 4) if rewards else None,
        "return_last10": round(statistics.fmean(rewards[-tenth:]), 4) if rewards else None,
        "stopped": stopped,
        "run_dir": str(run_dir),
    }


def _rounded(value: float | None) -> float | None:
    return round(value, 4) if value is not None else None
