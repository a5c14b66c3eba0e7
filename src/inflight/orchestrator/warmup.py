"""Supervised warm-up on scripted episodes whose replies come from the environment, never from the solution.

It teaches a tiny model from scratch the answer format (and, with `warmup.tokens=all`, to read the
environment's text) so that RL starts with signal. Each environment supplies its warm-up replies through
`warmup_reply(obs, rng)`; an observation with `legal_actions` (BlackJack) gets one of them uniformly.
Either way the reply is independent of what would be the right answer: the improvement is RL's.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from typing import Any

import torch

from inflight.config import RunConfig
from inflight.envs.base import Environment
from inflight.errors import UserError
from inflight.metrics.logger import MetricsLogger
from inflight.rollouts.chat import ChatFormat
from inflight.rollouts.episodes import run_scripted_episode
from inflight.trainer import LossConfig, Trainer, TrainerConfig
from inflight.types import TrainSample

WarmupReply = Callable[[Any, random.Random], str]  # (observation, rng) -> reply text


def random_legal_reply(obs: Any, rng: random.Random) -> str:
    """One of `obs.legal_actions`, uniformly: the replies of an environment with a fixed action menu."""
    legal = getattr(obs, "legal_actions", None)
    if not legal:
        raise UserError(
            f"{type(obs).__name__} has no legal_actions and its environment no warmup_reply(obs, rng): "
            "give the environment one, pass warmup_reply= to format_warmup, or set warmup.sft_steps=0"
        )
    return str(rng.choice(legal))


def env_warmup_reply(env: Environment) -> WarmupReply:
    """The environment's own `warmup_reply(obs, rng)` if it has one, else a random legal action."""
    reply = getattr(env, "warmup_reply", None)
    return reply if callable(reply) else random_legal_reply


def format_warmup(
    model: torch.nn.Module,
    pad_id: int,
    chat: ChatFormat,
    make_env: Callable[[], Environment],
    cfg: RunConfig,
    logger: MetricsLogger,
    warmup_reply: WarmupReply | None = None,
) -> dict[str, float]:
    """cfg.warmup.sft_steps cross-entropy steps on scripted episodes; logged with phase=warmup.

    `warmup_reply` overrides the environment's replies (e.g. a recipe's own reply generator).
    """
    w = cfg.warmup
    trainer = Trainer(
        model,
        TrainerConfig(
            lr=w.sft_lr,
            micro_batch_size=cfg.trainer.micro_batch_size,
            micro_batch_tokens=cfg.trainer.micro_batch_tokens,
            device=cfg.trainer.device,
            loss=LossConfig(name="cross_entropy", reduction="token_mean"),
        ),
        pad_id=pad_id,
    )
    # One generator for episode seeds and replies, in this order: BlackJack's warm-up data are unchanged
    # since this was BlackJack-only.
    rng = random.Random(cfg.seed + 7919)
    env = make_env()
    reply = warmup_reply or env_warmup_reply(env)

    def policy(obs: Any) -> str:
        return reply(obs, rng)

    metrics: dict[str, float] = {}
    for step in range(w.sft_steps):
        starts = [rng.getrandbits(62) for _ in range(-(-w.sft_batch_size // w.sft_group_size))]
        seeds = [s for s in starts for _ in range(w.sft_group_size)][: w.sft_batch_size]
        rollouts = [run_scripted_episode(env, s, policy, chat, cfg.grpo.max_turns) for s in seeds]
        samples = [TrainSample.from_rollout(r, advantage=0.0) for r in rollouts]
        if w.tokens == "all":
            for sample in samples:
                sample.loss_mask = [1.0] * len(sample.token_ids)
        metrics = trainer.train_step(samples)
        metrics["reward_mean"] = statistics.fmean(r.reward for r in rollouts)
        logger.log(step, metrics, phase="warmup")
    env.close()
    return metrics
