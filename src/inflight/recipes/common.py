"""What every recipe does around the GRPO loop: build, warm up, evaluate before and after, summarise.

A recipe supplies its preset and its evaluation (`Evaluate`); this module owns the order of the phases,
the run directory's files (metrics.jsonl, checkpoint/, summary.json, curves.png) and the summary keys
every recipe shares. It knows nothing of any one task.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inflight.config import RunConfig
from inflight.envs import make_env
from inflight.envs.base import Environment
from inflight.metrics.logger import MetricsLogger
from inflight.metrics.plot import plot_run
from inflight.orchestrator.run import train
from inflight.orchestrator.setup import build_engine, build_trainer, load_policy, make_run_dir, pad_id
from inflight.orchestrator.sync_loop import LoopParts
from inflight.orchestrator.warmup import WarmupReply, format_warmup
from inflight.rollouts.chat import ChatFormat
from inflight.rollouts.episodes import run_episodes
from inflight.trainer import LossConfig
from inflight.trainer.checkpoint import checkpoint_step, save_checkpoint
from inflight.types import Rollout, SamplingParams

# (parts, cfg, num_episodes) -> eval metrics, at least "return_greedy" and "return" (sampled).
Evaluate = Callable[[LoopParts, RunConfig, int], dict[str, float]]


def tiny_model_loss(entropy_coef: float) -> LossConfig:
    """PPO (token mean) with the two terms that let a tiny model from scratch keep exploring under RL.

    A bonus on the entropy of the choice among the 3 likeliest tokens keeps several answers alive
    without pushing mass into tokens that break the answer format, and an exact KL(ref || pi) to the
    warmed-up model puts a floor under every answer the reference finds plausible (it restores an
    answer even after it stops being sampled). Without them BlackJack collapsed to always-stand and
    arithmetic to one answer per question (docs/benchmarks.md).
    """
    return LossConfig(
        name="ppo",
        reduction="token_mean",
        entropy_coef=entropy_coef,
        entropy_top_k=3,
        kl_coef=0.1,
        kl_estimator="exact_ref",
    )


def env_factory(cfg: RunConfig) -> Callable[[], Environment]:
    def new_env() -> Environment:
        return make_env(cfg.env.name, **cfg.env.kwargs)

    return new_env


def play_policy(
    parts: LoopParts,
    cfg: RunConfig,
    seeds: Sequence[int],
    greedy: bool,
    make_env: Callable[[], Environment] | None = None,
) -> list[Rollout]:
    """One episode per seed with the current policy (`make_env` defaults to the training env's).

    The policy being trained is the sampling distribution at the training temperature; it is evaluated by
    sampling with per-turn seeds fixed by the episode, so every evaluation of every policy sees the same
    episodes and the same random numbers. `greedy` evaluates its argmax decoding instead.
    """
    new_env = make_env or parts.make_env
    envs = [new_env() for _ in seeds]
    temperature = 0.0 if greedy else cfg.sampling.temperature
    params = SamplingParams(max_tokens=cfg.sampling.max_tokens_per_turn, temperature=temperature)
    try:
        return run_episodes(
            parts.engine,
            envs,
            list(seeds),
            ["eval"] * len(seeds),
            parts.chat,
            params,
            cfg.grpo.max_turns,
            sampling_seed=None if greedy else cfg.eval.seed,
        )
    finally:
        for env in envs:
            env.close()


def episode_metrics(rollouts: Sequence[Rollout], keys: Sequence[str], suffix: str = "") -> dict[str, float]:
    """Mean return, and the mean of each named env metric (e.g. `correct`), with `suffix` on every key."""
    out = {f"return{suffix}": statistics.fmean(r.reward for r in rollouts)}
    for key in keys:
        out[f"{key}{suffix}"] = statistics.fmean(r.metrics.get(key, 0.0) for r in rollouts)
    return out


def greedy_and_sampled(
    parts: LoopParts,
    cfg: RunConfig,
    seeds: Sequence[int],
    keys: Sequence[str] = (),
    make_env: Callable[[], Environment] | None = None,
) -> dict[str, float]:
    """`episode_metrics` of greedy decoding (keys end in `_greedy`) and of the sampling policy."""
    greedy = play_policy(parts, cfg, seeds, greedy=True, make_env=make_env)
    sampled = play_policy(parts, cfg, seeds, greedy=False, make_env=make_env)
    return episode_metrics(greedy, keys, "_greedy") | episode_metrics(sampled, keys)


@dataclass
class RecipeRun:
    """A finished training run, before its summary is written."""

    cfg: RunConfig
    run_dir: Path
    logger: MetricsLogger
    parts: LoopParts
    first_step: int  # where this process started: the step of the checkpoint it resumed, else 0
    history: list[dict[str, float]]  # per-step training metrics of the steps this process ran
    initial: dict[str, float]  # evaluation before RL (after the warm-up)
    final: dict[str, float]  # evaluation after RL
    t0: float  # perf_counter at the start


def run_recipe(cfg: RunConfig, evaluate: Evaluate, warmup_reply: WarmupReply | None = None) -> RecipeRun:
    """Warm-up (if cfg.warmup.sft_steps), evaluation, cfg.grpo.steps of GRPO (the sync loop or the
    pipeline, by cfg.mode), evaluation, checkpoint."""
    t0 = time.perf_counter()
    run_dir = make_run_dir(cfg)
    # Before any weights load: a damaged checkpoint fails now, in one line.
    first_step = checkpoint_step(run_dir / "checkpoint")
    logger = MetricsLogger(run_dir)
    model, tokenizer = load_policy(cfg)
    chat = ChatFormat.for_model(tokenizer, model)
    new_env = env_factory(cfg)

    if cfg.warmup.sft_steps:
        format_warmup(model, pad_id(tokenizer), chat, new_env, cfg, logger, warmup_reply)
    # After the warm-up: the reference model is the warmed-up model.
    trainer = build_trainer(model, tokenizer, cfg.trainer, cfg.grpo.steps)
    parts = LoopParts(build_engine(cfg, model, tokenizer), trainer, chat, new_env)

    initial = evaluate(parts, cfg, cfg.eval.num_episodes)
    logger.log(0, initial, phase="eval")
    history = train(
        parts, cfg, logger, str(run_dir), lambda: evaluate(parts, cfg, cfg.eval.num_episodes_during)
    )
    final = evaluate(parts, cfg, cfg.eval.num_episodes)
    last_step = first_step + len(history)
    logger.log(last_step, final, phase="eval")
    if cfg.mode == "sync":  # the pipeline writes its own (with stream offsets and buffered groups)
        save_checkpoint(trainer, run_dir / "checkpoint", extra={"step": last_step})
    return RecipeRun(cfg, run_dir, logger, parts, first_step, history, initial, final, t0)


def build_summary(
    run: RecipeRun, counts: dict[str, Any], extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The keys every recipe reports, in this order: recipe, steps (all of the run's, those before a resume
    included), wall_s, `counts` (what was evaluated), return_initial/final (greedy),
    return_initial/final_sampled, `extra`, return_first10/last10 (mean training reward of the first and
    last tenth of the steps this process ran), run_dir."""
    rewards = [h["reward_mean"] for h in run.history]
    tenth = max(1, len(rewards) // 10)
    return {
        "recipe": run.cfg.recipe,
        "steps": run.first_step + len(run.history),
        "wall_s": round(time.perf_counter() - run.t0, 1),
        **counts,
        # Greedy decoding of the policy (the convention of the reference numbers in the docs), and the
        # sampling policy itself at the training temperature, both on the same episodes.
        "return_initial": round(run.initial["return_greedy"], 4),
        "return_final": round(run.final["return_greedy"], 4),
        "return_initial_sampled": round(run.initial["return"], 4),
        "return_final_sampled": round(run.final["return"], 4),
        **(extra or {}),
        "return_first10": round(statistics.fmean(rewards[:tenth]), 4) if rewards else None,
        "return_last10": round(statistics.fmean(rewards[-tenth:]), 4) if rewards else None,
        "run_dir": str(run.run_dir),
    }


def finish(run: RecipeRun, summary: dict[str, Any]) -> dict[str, Any]:
    """Log the summary, write summary.json and curves.png; returns the summary."""
    run.logger.log(run.first_step + len(run.history), summary, phase="summary")
    run.logger.close()
    (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_run(run.run_dir)
    return summary


def rate_summary(run: RecipeRun, key: str, name: str) -> dict[str, float]:
    """Summary entries for the eval rate of env metric `key` (e.g. `correct`) under `name` (e.g.
    `accuracy`): greedy before/after RL, then sampled before/after."""
    return {
        f"{name}_initial": round(run.initial[f"{key}_greedy"], 4),
        f"{name}_final": round(run.final[f"{key}_greedy"], 4),
        f"{name}_initial_sampled": round(run.initial[key], 4),
        f"{name}_final_sampled": round(run.final[key], 4),
    }
