"""Supervised warm-up for tasks written with the rollout API: the task's own `generate_rollout`,
played by a scripted policy (legal replies from Python, never the task's solution).

Like the Env warm-up (`warmup.py`), it teaches a tiny model from scratch the reply format and, with
`warmup.tokens=all`, to read the conversation; RL has to do the rest.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from collections.abc import Callable
from typing import Any

import torch

from inflight.config import RunConfig
from inflight.metrics.logger import MetricsLogger
from inflight.orchestrator.sync_loop import sampling_params
from inflight.rollouts.api import GenerateFn, RolloutContext
from inflight.rollouts.chat import ChatFormat
from inflight.trainer import LossConfig, Trainer, TrainerConfig
from inflight.types import Rollout, TrainSample


async def _scripted_rollouts(
    task: Any, chat: ChatFormat, make_policy: Callable[[int], GenerateFn], problems: list[int], cfg: RunConfig
) -> list[Rollout]:
    params = sampling_params(cfg)

    async def one(k: int) -> Rollout:
        ctx = RolloutContext(make_policy(k), chat, params, str(k), k, 0, None, cfg)
        return await task.generate_rollout(ctx, task.problem(k))

    return list(await asyncio.gather(*(one(k) for k in problems)))


def task_warmup(
    model: torch.nn.Module,
    pad_id: int,
    task: Any,
    chat: ChatFormat,
    make_policy: Callable[[int], GenerateFn],
    cfg: RunConfig,
    logger: MetricsLogger,
) -> dict[str, float]:
    """cfg.warmup.sft_steps cross-entropy steps on scripted rollouts; logged with phase=warmup.

    `make_policy(seed)` returns the scripted policy of one rollout (e.g. `rollouts.api.scripted_policy`).
    """
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
    metrics: dict[str, float] = {}
    for step in range(w.sft_steps):
        problems = [rng.getrandbits(30) for _ in range(w.sft_batch_size)]
        rollouts = asyncio.run(_scripted_rollouts(task, chat, make_policy, problems, cfg))
        samples = [TrainSample.from_rollout(r, advantage=0.0) for r in rollouts]
        if w.tokens == "all":
            for sample in samples:
                sample.loss_mask = [1.0] * len(sample.token_ids)
        metrics = trainer.train_step(samples)
        metrics["reward_mean"] = statistics.fmean(r.reward for r in rollouts)
        logger.log(step, metrics, phase="warmup")
    return metrics
