"""BlackJack on the tiny model: format warm-up, GRPO, and evaluation on 10,000 fixed hands.

A task written as an Env (`BlackJackEnv`: one hand per episode; the warm-up's replies are random legal
actions). The summary compares the policy before and after RL with basic strategy on the same hands.
"""

from __future__ import annotations

import statistics
from typing import Any

from inflight.config import EngineConfig, EvalConfig, GRPOConfig, RunConfig, SamplingConfig, WarmupConfig
from inflight.envs.blackjack import BlackJackEnv, basic_strategy_policy, play_hands
from inflight.orchestrator.task import env_test_seeds
from inflight.recipes.common import tiny_model_loss
from inflight.trainer import TrainerConfig

make_env = BlackJackEnv  # env.kwargs (format_penalty) go to its constructor


def preset() -> RunConfig:
    """Defaults measured on a 2-core CPU (docs/benchmarks.md), in the default mode (the asynchronous
    pipeline with active sampling: every batch is 16 groups whose rewards differ)."""
    return RunConfig(
        trainer=TrainerConfig(
            lr=3e-4,
            # Decays to 3e-5 by the last step: the greedy policy's choice in close states flipped from
            # one evaluation to the next at a constant lr (docs/benchmarks.md).
            lr_schedule="linear",
            lr_final_frac=0.1,
            # Seeds collapsed to always-stand without the entropy bonus and KL floor (see tiny_model_loss).
            loss=tiny_model_loss(entropy_coef=0.3),
        ),
        sampling=SamplingConfig(temperature=1.0, max_tokens_per_turn=4),
        # Std-normalised group advantages: groups of low totals, whose rewards differ little, weigh as
        # much as the high totals, whose busts dominate the raw reward spread.
        # 450 steps: greedy play still improved from 300 to 450 (seeds 0 and 1: -0.065/-0.072 at 300,
        # -0.058/-0.057 at 450; basic strategy -0.038), within make run's 240 s (docs/benchmarks.md).
        grpo=GRPOConfig(steps=450, prompts_per_step=16, group_size=8, advantage="mean_std", max_turns=8),
        # Next-token prediction on transcripts of random legal play: the tiny model learns to read
        # the cards and to answer `hit`/`stand`; the replies are random, never the strategy.
        warmup=WarmupConfig(sft_steps=100, sft_batch_size=64, sft_lr=3e-3, tokens="all"),
        # A hand's next turn resumes from the K/V its last turn left (128 spare rows of ~2 MB each).
        engine=EngineConfig(max_batch_size=128, prefix_cache_rows=128),
        # The learning bar is greedy play on the 10,000 fixed hands; the sampled policy's return is reported
        # on the first 2,000 of them (standard error ~0.02), where it costs a fifth. So is the policy's
        # before training: the warm-up leaves some seeds hitting on every total, whose hands run ~3 turns
        # (seed 0: 23 s for the 10,000, against 12 s for the trained policy's).
        eval=EvalConfig(
            num_episodes=10_000,
            num_episodes_sampled=2_000,
            num_episodes_initial=2_000,
            every_steps=100,
            num_episodes_during=1_000,
        ),
    )


def summarize(cfg: RunConfig, initial: dict[str, float], final: dict[str, float]) -> dict[str, Any]:
    """Basic strategy's mean return on the evaluated hands: the reference the policy is measured against;
    and the greedy policy's decisions other than basic strategy's per hand, before and after RL."""
    hands = env_test_seeds(cfg.eval.num_episodes)
    out: dict[str, Any] = {
        "return_basic_strategy": round(statistics.fmean(play_hands(basic_strategy_policy, hands)), 4)
    }
    for name, metrics in (("initial", initial), ("final", final)):
        if "strategy_errors_greedy" in metrics:
            out[f"strategy_errors_{name}"] = round(metrics["strategy_errors_greedy"], 4)
    return out
