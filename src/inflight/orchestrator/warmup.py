"""Supervised warm-up on scripted episodes with random *legal* replies.

It teaches a tiny model from scratch the answer format (and, with `warmup.tokens=all`, to read the
environment's text) so that RL starts with signal. Replies are drawn uniformly from the legal ones,
never from the task's solution.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from typing import Any

import torch

from inflight.config import RunConfig
from inflight.envs.base import Environment
from inflight.metrics.logger import MetricsLogger
from inflight.rollouts.chat import ChatFormat
from inflight.rollouts.episodes import run_scripted_episode
from inflight.trainer import LossConfig, Trainer, TrainerConfig
from inflight.types import TrainSample


def random_legal_reply(rng: random.Random) -> Callable[[Any], str]:
    def policy(obs: Any) -> str:
        return rng.choice(obs.legal_actions)

    return policy


def format_warmup(
    model: torch.nn.Module,
    pad_id: int,
    chat: ChatFormat,
    make_env: Callable[[], Environment],
    cfg: RunConfig,
    logger: MetricsLogger,
) -> dict[str, float]:
    """cfg.warmup.sft_steps cross-entropy steps on scripted episodes; logged with phase=warmup."""
    w = cfg.warmup
    trainer = Trainer(
        model,
        TrainerConfig(
            lr=w.sft_lr,
            micro_batch_size=cfg.trainer.micro_batch_size,
            loss=LossConfig(name="cross_entropy", reduction="token_mean"),
        ),
        pad_id=pad_id,
    )
    rng = random.Random(cfg.seed + 7919)
    policy = random_legal_reply(rng)
    env = make_env()
    metrics: dict[str, float] = {}
    for step in range(w.sft_steps):
        seeds = [rng.getrandbits(62) for _ in range(w.sft_batch_size)]
        rollouts = [run_scripted_episode(env, s, policy, chat, cfg.grpo.max_turns) for s in seeds]
        samples = [TrainSample.from_rollout(r, advantage=0.0) for r in rollouts]
        if w.tokens == "all":
            for sample in samples:
                sample.loss_mask = [1.0] * len(sample.token_ids)
        metrics = trainer.train_step(samples)
        metrics["reward_mean"] = statistics.fmean(r.reward for r in rollouts)
        logger.log(step, metrics, phase="warmup")
    return metrics
