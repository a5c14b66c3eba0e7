"""The on-policy GRPO reference loop, readable top to bottom.

Each step:
  1. sample   prompts_per_step prompts (environment seeds) x group_size episodes with the engine,
              whose weights are exactly the trainer's (version == trainer.version: lag 0);
  2. rewards  -> advantages, per group (`losses.group_advantages`); groups whose rewards are all
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

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from inflight.config import RunConfig
from inflight.envs.base import Environment
from inflight.inference.engine import Engine
from inflight.losses import group_advantages
from inflight.losses.advantages import AdvantageMethod
from inflight.metrics.logger import MetricsLogger
from inflight.metrics.progress import StepProgress
from inflight.rollouts.chat import ChatFormat
from inflight.rollouts.episodes import run_episodes
from inflight.trainer import Trainer
from inflight.trainer.checkpoint import resume_checkpoint, save_checkpoint
from inflight.types import Rollout, RolloutGroup, SamplingParams, TrainSample, WeightUpdate


@dataclass
class LoopParts:
    """What the loop drives; built by `orchestrator.setup` and shared with the recipe's evaluation."""

    engine: Engine
    trainer: Trainer
    chat: ChatFormat
    make_env: Callable[[], Environment]


def prompt_seeds(cfg: RunConfig, step: int) -> list[int]:
    """Training prompts of a step: deterministic in (run seed, step), disjoint from evaluation seeds."""
    base = (cfg.seed * 100_003 + step) * cfg.grpo.prompts_per_step
    return [base + i for i in range(cfg.grpo.prompts_per_step)]


def sampling_params(cfg: RunConfig) -> SamplingParams:
    """One policy turn during training."""
    return SamplingParams(
        max_tokens=cfg.sampling.max_tokens_per_turn,
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        top_k=cfg.sampling.top_k,
    )


def sample_groups(parts: LoopParts, cfg: RunConfig, step: int) -> list[RolloutGroup]:
    g = cfg.grpo.group_size
    seeds = [s for s in prompt_seeds(cfg, step) for _ in range(g)]  # each prompt g times: one group
    group_ids = [f"{step}-{s}" for s in seeds]
    params = sampling_params(cfg)
    envs = [parts.make_env() for _ in seeds]
    # Seeded per (prompt, sample, turn): the tokens do not depend on the engine's batch, so the
    # asynchronous pipeline at max_staleness_steps=0 draws exactly these samples.
    rollouts = run_episodes(
        parts.engine,
        envs,
        seeds,
        group_ids,
        parts.chat,
        params,
        cfg.grpo.max_turns,
        sampling_seed=cfg.seed,
        sample_indices=[i % g for i in range(len(seeds))],
    )
    return [RolloutGroup(group_ids[i], rollouts[i : i + g]) for i in range(0, len(rollouts), g)]


def to_train_samples(groups: list[RolloutGroup], advantage: AdvantageMethod) -> list[TrainSample]:
    """Per-group advantages from the rewards, spread over each rollout's policy tokens."""
    samples: list[TrainSample] = []
    for grp in groups:
        adv = group_advantages(torch.tensor(grp.rewards), advantage)
        samples += [TrainSample.from_rollout(r, float(a)) for r, a in zip(grp.rollouts, adv, strict=True)]
    return samples


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
    evaluate: Callable[[], dict[str, float]] | None = None,
) -> list[dict[str, float]]:
    """Run on-policy steps up to cfg.grpo.steps, continuing the newest complete checkpoint in run_dir if
    there is one; returns the metrics of the steps this call ran.

    `evaluate` (the recipe's held-out evaluation) runs every cfg.eval.every_steps, logged as phase=eval.
    """
    engine, trainer = parts.engine, parts.trainer
    # Prompts are a function of (seed, step), so starting at the checkpoint's step repeats no prompt.
    first_step = int(resume_checkpoint(trainer, f"{run_dir}/checkpoint").get("step", 0))
    engine.update_weights(WeightUpdate(trainer.version, trainer.weights()))
    history: list[dict[str, float]] = []
    with StepProgress(cfg.grpo.steps, f"{cfg.recipe} (sync GRPO)", enabled=cfg.progress) as progress:
        for step in range(first_step, cfg.grpo.steps):
            t0 = time.perf_counter()
            groups = sample_groups(parts, cfg, step)  # 1. sample
            t_sample = time.perf_counter() - t0

            informative = [grp for grp in groups if grp.is_informative]  # 2. rewards -> advantages
            samples = to_train_samples(informative, cfg.grpo.advantage)

            rollouts = [r for grp in groups for r in grp.rollouts]
            metrics = rollout_metrics(rollouts)
            versions = [r.min_version for r in rollouts if r.num_generated]
            metrics["lag_steps_max"] = float(trainer.version - min(versions)) if versions else 0.0
            metrics["groups_uninformative_frac"] = 1 - len(informative) / len(groups)
            if samples:  # 3. loss + optimizer step
                metrics.update(trainer.train_step(samples))
                engine.update_weights(WeightUpdate(trainer.version, trainer.weights()))  # 4. publish
            else:
                metrics["steps_skipped"] = 1.0  # nothing informative: no update, counted
            step_s = time.perf_counter() - t0
            metrics.update(
                version=float(trainer.version),
                sample_s=t_sample,
                step_s=step_s,
                completions_per_s=len(rollouts) / t_sample,
                gen_tokens_per_s=metrics["generated_tokens"] / t_sample,
            )
            logger.log(step, metrics)  # 5. log
            history.append(metrics)
            progress.update(step + 1, metrics["reward_mean"])
            if evaluate and cfg.eval.every_steps and (step + 1) % cfg.eval.every_steps == 0:
                logger.log(step + 1, evaluate(), phase="eval")
            if cfg.checkpoint_every_steps and (step + 1) % cfg.checkpoint_every_steps == 0:
                save_checkpoint(trainer, f"{run_dir}/checkpoint", extra={"step": step + 1})
    return history
