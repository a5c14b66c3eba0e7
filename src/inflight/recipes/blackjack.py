"""BlackJack on the tiny model: format warm-up, on-policy GRPO, and evaluation on 10,000 fixed hands.

The summary compares the greedy policy before RL and after it with basic strategy on the same hands.
"""

from __future__ import annotations

import json
import statistics
import time

from inflight.config import EvalConfig, GRPOConfig, RunConfig, SamplingConfig, WarmupConfig
from inflight.envs import make_env
from inflight.envs.base import episode_seeds
from inflight.envs.blackjack import basic_strategy_policy, play_hands
from inflight.inference.builtin import BuiltinEngineConfig
from inflight.metrics.logger import MetricsLogger
from inflight.metrics.plot import plot_run
from inflight.orchestrator.setup import build_engine, build_trainer, load_policy, make_run_dir, pad_id
from inflight.orchestrator.sync_loop import LoopParts, train
from inflight.orchestrator.warmup import format_warmup
from inflight.rollouts.chat import ChatFormat
from inflight.rollouts.episodes import run_episodes
from inflight.trainer import LossConfig, TrainerConfig
from inflight.trainer.checkpoint import save_checkpoint
from inflight.types import SamplingParams


def preset() -> RunConfig:
    """Defaults measured on a 2-core CPU (docs/benchmarks.md): about 6 minutes end to end."""
    return RunConfig(
        recipe="blackjack",
        trainer=TrainerConfig(
            lr=3e-4,
            micro_batch_size=32,
            # The bonus is the entropy of the choice among the 3 likeliest tokens: exploration between
            # hit and stand without pushing mass into tokens that break the answer format.
            # and an exact KL(ref || pi) to the warmed-up model: a floor under every action the reference
            # finds plausible (it restores `hit` even after it stops being sampled; seeds collapsed to
            # always-stand without it).
            loss=LossConfig(
                name="ppo",
                reduction="token_mean",
                entropy_coef=0.3,
                entropy_top_k=3,
                kl_coef=0.1,
                kl_estimator="exact_ref",
            ),
        ),
        sampling=SamplingConfig(temperature=1.0, max_tokens_per_turn=4),
        # Std-normalised group advantages: groups of low totals, whose rewards differ little, weigh as
        # much as the high totals, whose busts dominate the raw reward spread.
        grpo=GRPOConfig(steps=400, prompts_per_step=16, group_size=8, advantage="mean_std", max_turns=8),
        # Next-token prediction on transcripts of random legal play: the tiny model learns to read
        # the cards and to answer `hit`/`stand`; the replies are random, never the strategy.
        warmup=WarmupConfig(sft_steps=100, sft_batch_size=64, sft_lr=3e-3, tokens="all"),
        engine=BuiltinEngineConfig(max_batch_size=128),
        eval=EvalConfig(num_episodes=10_000, every_steps=100, num_episodes_during=1_000),
    )


def evaluate(parts: LoopParts, cfg: RunConfig, num_hands: int, greedy: bool) -> float:
    """Mean return on the first `num_hands` fixed evaluation hands.

    The policy being trained is the sampling distribution at the training temperature; it is
    evaluated by sampling with per-turn seeds fixed by the hand, so every evaluation of every policy
    sees the same cards and the same random numbers. `greedy` evaluates its argmax decoding instead.
    """
    seeds = episode_seeds(num_hands, cfg.eval.seed)
    envs = [parts.make_env() for _ in seeds]
    temperature = 0.0 if greedy else cfg.sampling.temperature
    params = SamplingParams(max_tokens=cfg.sampling.max_tokens_per_turn, temperature=temperature)
    rollouts = run_episodes(
        parts.engine,
        envs,
        seeds,
        ["eval"] * len(seeds),
        parts.chat,
        params,
        cfg.grpo.max_turns,
        sampling_seed=None if greedy else cfg.eval.seed,
    )
    return statistics.fmean(r.reward for r in rollouts)


def evaluate_both(parts: LoopParts, cfg: RunConfig, num_hands: int) -> dict[str, float]:
    return {
        "return_greedy": evaluate(parts, cfg, num_hands, greedy=True),
        "return": evaluate(parts, cfg, num_hands, greedy=False),
    }


def main(cfg: RunConfig) -> dict:
    t0 = time.perf_counter()
    run_dir = make_run_dir(cfg)
    logger = MetricsLogger(run_dir)
    model, tokenizer = load_policy(cfg)
    chat = ChatFormat(tokenizer)

    def new_env():
        return make_env(cfg.env.name, **cfg.env.kwargs)

    if cfg.warmup.sft_steps:
        format_warmup(model, pad_id(tokenizer), chat, new_env, cfg, logger)
    trainer = build_trainer(model, tokenizer, cfg.trainer)  # after the warm-up: reference = warmed-up model
    parts = LoopParts(build_engine(cfg, model, tokenizer), trainer, chat, new_env)

    initial = evaluate_both(parts, cfg, cfg.eval.num_episodes)
    logger.log(0, initial, phase="eval")
    history = train(
        parts,
        cfg,
        logger,
        str(run_dir),
        lambda: evaluate_both(parts, cfg, cfg.eval.num_episodes_during),
    )
    final = evaluate_both(parts, cfg, cfg.eval.num_episodes)
    logger.log(len(history), final, phase="eval")
    basic = statistics.fmean(
        play_hands(basic_strategy_policy, episode_seeds(cfg.eval.num_episodes, cfg.eval.seed))
    )

    save_checkpoint(trainer, run_dir / "checkpoint", extra={"step": len(history)})
    rewards = [h["reward_mean"] for h in history]
    tenth = max(1, len(rewards) // 10)
    summary = {
        "recipe": cfg.recipe,
        "steps": len(history),
        "wall_s": round(time.perf_counter() - t0, 1),
        "eval_hands": cfg.eval.num_episodes,
        # Greedy decoding of the policy (the convention of the reference numbers in the docs), and the
        # sampling policy itself at the training temperature, both on the same hands.
        "return_initial": round(initial["return_greedy"], 4),
        "return_final": round(final["return_greedy"], 4),
        "return_initial_sampled": round(initial["return"], 4),
        "return_final_sampled": round(final["return"], 4),
        "return_basic_strategy": round(basic, 4),
        "return_first10": round(statistics.fmean(rewards[:tenth]), 4) if rewards else None,
        "return_last10": round(statistics.fmean(rewards[-tenth:]), 4) if rewards else None,
        "run_dir": str(run_dir),
    }
    logger.log(len(history), summary, phase="summary")
    logger.close()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_run(run_dir)
    return summary
