"""Supervised warm-up for tasks written with the rollout API: the task's own `generate_rollout` on its
train problems, played by a scripted policy whose replies come from the task's `warmup_reply(transcript,
rng)` (legal replies from Python, never the task's solution).

Like the Env warm-up (`warmup.py`), it teaches a tiny model from scratch the reply format and, with
`warmup.tokens=all`, to read the conversation; RL has to do the rest. It keeps its state in RUN_DIR/warmup/
and stops after its step in flight on a signal, as that one does.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path

import torch

from inflight.config import RunConfig
from inflight.errors import UserError
from inflight.metrics.logger import MetricsLogger
from inflight.orchestrator.guard import RolloutGuard
from inflight.orchestrator.rollout_group import sampling_params
from inflight.orchestrator.stopping import StopRequest
from inflight.orchestrator.task import Problems, Task, WarmupReply, train_problem
from inflight.orchestrator.warmup import (
    checked_reply,
    resume_warmup,
    save_warmup,
    train_on_scripted,
    warmup_progress,
    warmup_trainer,
)
from inflight.rollouts.api import RolloutContext, scripted_policy
from inflight.rollouts.chat import ChatFormat
from inflight.types import Rollout


async def _scripted_rollouts(
    task: Task,
    problems: Problems,
    chat: ChatFormat,
    reply: WarmupReply,
    indices: list[int],
    cfg: RunConfig,
    guard: RolloutGuard,
) -> list[Rollout]:
    params = sampling_params(cfg)

    def policy(k: int) -> Callable[[str], str]:
        rng = random.Random(k)  # each rollout its own replies, whatever runs beside it
        return lambda transcript: reply(transcript, rng)

    async def one(k: int) -> Rollout | None:
        # k is drawn at random (a 30-bit number, also its replies' seed); the rollout's problem index is the
        # train problem it plays, what a failure's log line names.
        i = k % len(problems)
        ctx = RolloutContext(scripted_policy(chat, policy(k)), chat, params, str(k), i, 0, None, cfg)
        return await guard.run(task.generate_rollout, ctx, train_problem(problems, k))

    results = await asyncio.gather(*(one(k) for k in indices))
    return [r for r in results if r is not None]


def task_warmup(
    model: torch.nn.Module,
    pad_id: int,
    task: Task,
    problems: Problems,
    chat: ChatFormat,
    cfg: RunConfig,
    logger: MetricsLogger | None,
    *,
    state_dir: Path | None = None,
    stop: StopRequest | None = None,
) -> dict[str, float]:
    """cfg.warmup.sft_steps cross-entropy steps on scripted rollouts of train problems drawn at random;
    logged with phase=warmup (unless `logger` is None). Needs the task's `warmup_reply` (`run.check_task`
    says so first). `state_dir` and `stop`: as in `warmup.format_warmup`."""
    if task.warmup_reply is None:
        raise UserError(f"{task.name} has no warmup_reply(transcript, rng): set warmup.sft_steps=0")
    reply = checked_reply(task.warmup_reply, task.name)
    w = cfg.warmup
    trainer = warmup_trainer(model, pad_id, cfg)
    rng = random.Random(cfg.seed + 7919)
    first = resume_warmup(trainer, state_dir, rng)
    if first is None or first >= w.sft_steps:  # done, or warmup.sft_steps lowered since it stopped
        return {}
    guard = RolloutGuard(cfg.rollout, w.sft_batch_size, what="warm-up rollouts", phase="warm-up")
    metrics: dict[str, float] = {}
    step = first
    with warmup_progress(cfg) as progress:
        for step in range(first, w.sft_steps):
            indices = [rng.getrandbits(30) for _ in range(w.sft_batch_size)]
            rollouts = asyncio.run(_scripted_rollouts(task, problems, chat, reply, indices, cfg, guard))
            guard.check()
            if rollouts:
                metrics = train_on_scripted(trainer, rollouts, cfg, logger, step)
            progress.update(step + 1, metrics.get("reward_mean") if rollouts else None)
            if stop is not None and stop.is_set():
                break
    save_warmup(trainer, state_dir, step + 1, w.sft_steps, rng)
    return metrics
