"""Supervised warm-up on scripted episodes whose replies come from the environment, never from the solution.

It teaches a tiny model from scratch the answer format (and, with `warmup.tokens=all`, to read the
environment's text) so that RL starts with signal. Each environment supplies its warm-up replies through
`warmup_reply(obs, rng)`; an observation with `legal_actions` (BlackJack) gets one of them uniformly.
Either way the reply is independent of what would be the right answer: the improvement is RL's. Each
scripted episode goes through the rollout guard (`guard.py`), as the training's rollouts do: an environment
that fails (a server that is down, a `step` that raises) fails that episode, counted and logged, and past
`rollout.max_failed_frac` stops the run in one line.

Both warm-ups (this one and `task_warmup.py`) keep their state in RUN_DIR/warmup/ (a trainer checkpoint,
`trainer/checkpoint.py`): the weights once it is done, so that a resumed run loads the warmed-up model (the
base of a LoRA adapter, the KL reference) instead of training it again; and, when a signal (`stopping.py`)
stops it after its step in flight, the weights, the optimizer and the random state, so that the same
command continues it at the next step, logging each step once.
"""

from __future__ import annotations

import functools
import json
import random
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from inflight.config import RunConfig
from inflight.envs.base import Environment
from inflight.errors import describe
from inflight.metrics.logger import MetricsLogger
from inflight.metrics.progress import StepProgress
from inflight.orchestrator.guard import RolloutGuard
from inflight.orchestrator.stopping import StopRequest
from inflight.orchestrator.task import HookError
from inflight.rollouts.chat import ChatFormat
from inflight.rollouts.episodes import run_scripted_episode
from inflight.trainer import LossConfig, Trainer, TrainerConfig
from inflight.trainer.checkpoint import META, find_checkpoint, load_checkpoint, save_checkpoint
from inflight.types import Rollout, TrainSample

WarmupReply = Callable[[Any, random.Random], str]  # (observation, rng) -> reply text
WARMUP_DIR = "warmup"  # in the run directory: the warm-up's state (see the module docstring)


def warmup_trainer(model: torch.nn.Module, pad_id: int, cfg: RunConfig) -> Trainer:
    """The warm-up's own trainer: cross-entropy at warmup.sft_lr, over the whole model."""
    w = cfg.warmup
    return Trainer(
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


def warmup_steps_done(state_dir: Path | None) -> tuple[int, int] | None:
    """(steps done, steps it was asked for) of the warm-up saved in `state_dir`, or None when none is."""
    found = find_checkpoint(state_dir) if state_dir is not None else None
    if found is None:
        return None
    meta = json.loads((found / META).read_text())
    return int(meta["step"]), int(meta["sft_steps"])


def resume_warmup(trainer: Trainer, state_dir: Path | None, rng: random.Random) -> int | None:
    """Load the warm-up saved in `state_dir` into `trainer` (and its random state into `rng`); returns the
    step to go on from (0 with nothing saved), or None when the saved warm-up is done: its weights are
    loaded and there is nothing left to train (whatever warmup.sft_steps says now)."""
    done = warmup_steps_done(state_dir)
    if state_dir is None or done is None:
        return 0
    step, asked = done
    found = find_checkpoint(state_dir) or state_dir
    meta = load_checkpoint(trainer, found, load_optimizer=step < asked)
    if step >= asked:
        return None
    version, internal, gauss = meta["rng"]
    rng.setstate((version, tuple(internal), gauss))
    return step


def save_warmup(trainer: Trainer, state_dir: Path | None, step: int, asked: int, rng: random.Random) -> None:
    """The warm-up's state after `step` of its `asked` steps: the weights, and, when it is not done, what
    continuing it needs (the optimizer and the random state)."""
    if state_dir is None:
        return
    extra: dict[str, Any] = {"step": step, "sft_steps": asked}
    if step < asked:
        extra["rng"] = rng.getstate()  # (int, tuple of ints, float | None): JSON as a list
    save_checkpoint(trainer, state_dir, extra, optimizer=step < asked)


def train_on_scripted(
    trainer: Trainer, rollouts: list[Rollout], cfg: RunConfig, logger: MetricsLogger | None, step: int
) -> dict[str, float]:
    """One warm-up step on scripted rollouts: cross-entropy on their replies (`warmup.tokens=all`: on every
    token), logged with phase=warmup unless `logger` is None. Both warm-ups' step."""
    samples = [TrainSample.from_rollout(r, advantage=0.0) for r in rollouts]
    if cfg.warmup.tokens == "all":
        for sample in samples:
            sample.loss_mask = [1.0] * len(sample.token_ids)
    metrics = trainer.train_step(samples)
    metrics["reward_mean"] = statistics.fmean(r.reward for r in rollouts)
    if logger is not None:
        logger.log(step, metrics, phase="warmup")
    return metrics


def warmup_progress(cfg: RunConfig) -> StepProgress:
    """The warm-up's progress, shown as the training's is (`cfg.progress`): a long warm-up is not silent."""
    title = f"{cfg.recipe} (warm-up)"
    return StepProgress(
        cfg.warmup.sft_steps, title, enabled=cfg.progress, every_steps=cfg.metrics.print_every_steps
    )


def checked_reply(reply: WarmupReply, owner: str) -> WarmupReply:
    """`reply` (`owner`'s warmup_reply), a failure of it made one line naming it (HookError): a scripted
    reply that raises, or is not a str (None failed deep in the tokenizer), is a bug in the task, not a
    rollout to count."""

    def checked(seen: Any, rng: random.Random) -> str:
        try:
            text = reply(seen, rng)
        except HookError:  # already one line (`random_legal_reply`'s)
            raise
        except Exception as e:
            raise HookError(f"{owner}: warmup_reply(seen, rng) raised {describe(e)}") from None
        if not isinstance(text, str):
            raise HookError(
                f"{owner}: warmup_reply(seen, rng) must return the reply as a str, not a "
                f"{type(text).__name__} ({text!r:.40})"
            )
        return text

    return checked


def random_legal_reply(obs: Any, rng: random.Random) -> str:
    """One of `obs.legal_actions`, uniformly: the replies of an environment with a fixed action menu. An
    observation without them is a task that cannot warm up (HookError: the run ends, no rollout counted)."""
    legal = getattr(obs, "legal_actions", None)
    if not legal:
        raise HookError(
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
    logger: MetricsLogger | None,
    warmup_reply: WarmupReply | None = None,
    *,
    state_dir: Path | None = None,
    stop: StopRequest | None = None,
) -> dict[str, float]:
    """cfg.warmup.sft_steps cross-entropy steps on scripted episodes; logged with phase=warmup (unless
    `logger` is None).

    `warmup_reply` overrides the environment's replies (e.g. a recipe's own reply generator; pass it
    through `checked_reply`, naming its task). `state_dir` (RUN_DIR/warmup): where the warm-up's state is
    saved and continued from (see the module docstring). `stop`, once set, ends it after the step in
    flight (the state saved); `warmup_steps_done` tells. Its progress shows as the training's does. A
    failed episode is left out of its step (`_scripted_rollouts`); a step left with none trains nothing.
    """
    w = cfg.warmup
    trainer = warmup_trainer(model, pad_id, cfg)
    # One generator for episode seeds and replies, in this order: BlackJack's warm-up data are unchanged
    # since this was BlackJack-only.
    rng = random.Random(cfg.seed + 7919)
    first = resume_warmup(trainer, state_dir, rng)
    if first is None or first >= w.sft_steps:  # done, or warmup.sft_steps lowered since it stopped
        return {}
    env = make_env()
    reply = warmup_reply or checked_reply(env_warmup_reply(env), type(env).__name__)

    def policy(obs: Any) -> str:
        return reply(obs, rng)

    guard = RolloutGuard(cfg.rollout, w.sft_batch_size, what="warm-up rollouts", phase="warm-up")
    metrics: dict[str, float] = {}
    step = first
    with warmup_progress(cfg) as progress:
        for step in range(first, w.sft_steps):
            starts = [rng.getrandbits(62) for _ in range(-(-w.sft_batch_size // w.sft_group_size))]
            seeds = [s for s in starts for _ in range(w.sft_group_size)][: w.sft_batch_size]
            rollouts = _scripted_rollouts(env, seeds, policy, chat, cfg, guard)
            guard.check()  # too many failed: stop, naming the most common error
            if rollouts:
                metrics = train_on_scripted(trainer, rollouts, cfg, logger, step)
            progress.update(step + 1, metrics.get("reward_mean") if rollouts else None)
            if stop is not None and stop.is_set():
                break
    env.close()
    save_warmup(trainer, state_dir, step + 1, w.sft_steps, rng)
    return metrics


def _scripted_rollouts(
    env: Environment,
    seeds: list[int],
    policy: Callable[[Any], str],
    chat: ChatFormat,
    cfg: RunConfig,
    guard: RolloutGuard,
) -> list[Rollout]:
    """One step's scripted episodes, in order on the one environment, each through `guard`: one whose
    environment fails is counted, logged and left out. Its log line names the episode's seed as its problem
    (an Env task's train problem i is seed i: `reset(seed=...)` plays it again) and its place in its group
    of warmup.sft_group_size episodes of that seed as its sample."""
    group_size = cfg.warmup.sft_group_size
    results = [
        guard.run_inline(
            functools.partial(run_scripted_episode, env, seed, policy, chat, cfg.grpo.max_turns),
            problem_index=seed,
            sample_index=j % group_size,
        )
        for j, seed in enumerate(seeds)
    ]
    return [r for r in results if r is not None]
