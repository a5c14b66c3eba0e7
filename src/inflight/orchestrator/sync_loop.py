"""The on-policy GRPO reference loop, readable top to bottom.

Each step:
  1. sample   the step's prompts_per_step problems of the task's train split x group_size rollouts
              (`task.generate_rollout`, all at once: `drivers.InlineDriver`), with weights exactly the
              trainer's (version == trainer.version: lag 0); a failed rollout is counted and left out
              (`guard.py`), a group left with fewer than 2 has no baseline and is dropped (counted);
  2. rewards  -> advantages, per group (`losses.batch_group_advantages`); groups whose rewards are all
              equal carry no signal and are left out of the batch (counted, never silent);
  3. loss     policy loss over the policy's tokens (`trainer.train_step`: micro-batches, AdamW);
  4. publish  the new weights into the engine (in-process: a copy, applied between decode steps);
  5. log      one JSONL line (reward, loss, KL, entropy, clip fraction, IS weights, logprob mismatch,
              tokens/s, step seconds).
How it departs from textbook GRPO: one optimizer step per batch (so the PPO ratio is 1 up to the
engine/trainer numerical mismatch, which is logged), an optional entropy bonus, and whole multi-turn
episodes as single samples with environment tokens masked out.
"""

from __future__ import annotations

import asyncio
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from inflight.config import RunConfig
from inflight.losses import batch_group_advantages
from inflight.losses.advantages import AdvantageMethod
from inflight.metrics.logger import MetricsLogger
from inflight.metrics.progress import StepProgress
from inflight.orchestrator.drivers import Driver, InlineDriver
from inflight.orchestrator.guard import RolloutGuard
from inflight.orchestrator.publish import publish
from inflight.orchestrator.rollout_group import play_group
from inflight.orchestrator.stopping import StopRequest
from inflight.orchestrator.task import Problems, Task, train_problem
from inflight.rollouts.api import GenerateFn
from inflight.rollouts.chat import ChatFormat
from inflight.trainer.process import StepTrainer
from inflight.types import Rollout, RolloutGroup, TrainSample


@dataclass
class LoopParts:
    """What both loops (this one and `pipeline.py`) drive; built by `orchestrator.run`."""

    engine: Any  # a BuiltinEngine: this loop steps it between the rollouts, the pipeline in its own thread
    trainer: StepTrainer  # a Trainer, or the pipeline's TrainerProcess
    chat: ChatFormat
    task: Task
    problems: Problems  # the task's "train" split; problem k of the run is `train_problem(problems, k)`
    # Set from outside (Ctrl-C, SIGTERM: `stopping.py`): the loop ends after the step in flight.
    stop: StopRequest | None = None


async def sample_groups(
    parts: LoopParts, cfg: RunConfig, step: int, generate: GenerateFn, *, guard: RolloutGuard
) -> list[RolloutGroup]:
    """The step's groups, problem k = step * prompts_per_step + i; a group is group_size rollouts of it."""
    per_step = cfg.grpo.prompts_per_step
    return list(
        await asyncio.gather(
            *(
                play_group(parts.task, train_problem(parts.problems, k), k, cfg, parts.chat, generate, guard)
                for k in range(step * per_step, (step + 1) * per_step)
            )
        )
    )


def to_train_samples(groups: list[RolloutGroup], advantage: AdvantageMethod) -> list[TrainSample]:
    """Per-group advantages from the rewards, spread over each rollout's policy tokens.

    The groups of one size go through `batch_group_advantages` together: one call per size, not one per
    group (a dozen tiny tensor ops per group cost the pipeline's trainer thread ~27 ms a BlackJack step
    while the engine thread held the GIL)."""
    by_size: dict[int, list[int]] = {}
    for i, grp in enumerate(groups):
        by_size.setdefault(len(grp.rollouts), []).append(i)
    advantages: list[list[float]] = [[] for _ in groups]
    for indices in by_size.values():
        rewards_N_G = torch.tensor([groups[i].rewards for i in indices])
        for i, row in zip(indices, batch_group_advantages(rewards_N_G, advantage).tolist(), strict=True):
            advantages[i] = row
    return [
        TrainSample.from_rollout(r, a)
        for grp, adv in zip(groups, advantages, strict=True)
        for r, a in zip(grp.rollouts, adv, strict=True)
    ]


def rollout_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    rewards = [r.reward for r in rollouts]
    out = {
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "episode_tokens_mean": statistics.fmean(len(r.token_ids) for r in rollouts),
        "generated_tokens": float(sum(r.num_generated for r in rollouts)),
        "truncated_frac": statistics.fmean(r.finish_reason == "length" for r in rollouts),
    }
    for key in sorted({k for r in rollouts for k in r.metrics}):
        out[f"env/{key}_mean"] = statistics.fmean(r.metrics.get(key, 0.0) for r in rollouts)
    return out


def train(
    parts: LoopParts,
    cfg: RunConfig,
    logger: MetricsLogger,
    run_dir: str,
    evaluate: Callable[[Driver], dict[str, Any]] | None = None,
) -> list[dict[str, float]]:
    """Run on-policy steps up to cfg.grpo.steps, continuing the newest complete checkpoint in run_dir if
    there is one; returns the metrics of the steps this call ran.

    `evaluate(driver)` (the held-out evaluation) runs every cfg.eval.every_steps; its row (`run.eval_row`,
    which labels it `eval: during`) is logged as phase=eval.
    """
    engine, trainer = parts.engine, parts.trainer
    driver = InlineDriver(engine)
    # Problem k is a function of k alone, so starting at the checkpoint's step repeats no problem.
    first_step = int(trainer.resume_checkpoint(f"{run_dir}/checkpoint").get("step", 0))
    guard = RolloutGuard(cfg.rollout, cfg.grpo.prompts_per_step * cfg.grpo.group_size)
    groups_dropped = 0
    history: list[dict[str, float]] = []
    title, every = f"{cfg.recipe} (sync GRPO)", cfg.metrics.print_every_steps
    publish(engine, trainer)
    with StepProgress(cfg.grpo.steps, title, enabled=cfg.progress, every_steps=every) as progress:
        for step in range(first_step, cfg.grpo.steps):
            t0 = time.perf_counter()
            drawn = driver.run(functools.partial(sample_groups, parts, cfg, step, guard=guard))  # 1. sample
            t_sample = time.perf_counter() - t0
            guard.check()  # too many failed rollouts: stop, naming the most common error
            groups = [grp for grp in drawn if len(grp.rollouts) >= 2]  # else no baseline: dropped
            groups_dropped += len(drawn) - len(groups)

            informative = [grp for grp in groups if grp.is_informative]  # 2. rewards -> advantages
            samples = to_train_samples(informative, cfg.grpo.advantage)

            rollouts = [r for grp in groups for r in grp.rollouts]
            metrics = rollout_metrics(rollouts) if rollouts else {"reward_mean": float("nan")}
            versions = [r.min_version for r in rollouts if r.num_generated]
            metrics["lag_steps_max"] = float(trainer.version - min(versions)) if versions else 0.0
            metrics["groups_uninformative_frac"] = 1 - len(informative) / max(len(groups), 1)
            metrics.update(guard.metrics(), groups_dropped_errors=float(groups_dropped))
            if samples:  # 3. loss + optimizer step
                metrics.update(trainer.train_step(samples))
                publish(engine, trainer)  # 4. publish
            else:
                metrics["steps_skipped"] = 1.0  # nothing informative: no update, counted
            step_s = time.perf_counter() - t0
            metrics.update(
                version=float(trainer.version),
                sample_s=t_sample,
                step_s=step_s,
                completions_per_s=len(rollouts) / t_sample,
                gen_tokens_per_s=metrics.get("generated_tokens", 0.0) / t_sample,
            )
            logger.log(step, metrics)  # 5. log
            logger.log_rollout_samples(step, rollouts, parts.chat.tokenizer.decode)  # every N steps
            history.append(metrics)
            progress.update(step + 1, metrics["reward_mean"])
            if evaluate and cfg.eval.every_steps and (step + 1) % cfg.eval.every_steps == 0:
                logger.log(step + 1, evaluate(driver), phase="eval")
            if cfg.checkpoint_every_steps and (step + 1) % cfg.checkpoint_every_steps == 0:
                trainer.save_checkpoint(f"{run_dir}/checkpoint", extra={"step": step + 1})
            if parts.stop is not None and parts.stop.is_set():
                break  # the run then checkpoints this step and writes its summary
    return history
