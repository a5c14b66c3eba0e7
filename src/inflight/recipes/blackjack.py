"""BlackJack on the tiny model: format warm-up, on-policy GRPO, and evaluation on 10,000 fixed hands.

The summary compares the greedy policy before RL and after it with basic strategy on the same hands.
"""

from __future__ import annotations

import statistics

from inflight.config import EvalConfig, GRPOConfig, RunConfig, SamplingConfig, WarmupConfig
from inflight.envs.base import episode_seeds
from inflight.envs.blackjack import basic_strategy_policy, play_hands
from inflight.inference.builtin import BuiltinEngineConfig
from inflight.orchestrator.sync_loop import LoopParts
from inflight.recipes.common import build_summary, finish, play_policy, run_recipe, tiny_model_loss
from inflight.trainer import TrainerConfig


def preset() -> RunConfig:
    """Defaults measured on a 2-core CPU (docs/benchmarks.md), in the default mode (the asynchronous
    pipeline with active sampling: every batch is 16 groups whose rewards differ)."""
    return RunConfig(
        recipe="blackjack",
        trainer=TrainerConfig(
            lr=3e-4,
            # Decays to 3e-5 by the last step: the greedy policy's choice in close states flipped from
            # one evaluation to the next at a constant lr (docs/benchmarks.md).
            lr_schedule="linear",
            lr_final_frac=0.1,
            micro_batch_size=32,
            # Seeds collapsed to always-stand without the entropy bonus and KL floor (see tiny_model_loss).
            loss=tiny_model_loss(entropy_coef=0.3),
        ),
        sampling=SamplingConfig(temperature=1.0, max_tokens_per_turn=4),
        # Std-normalised group advantages: groups of low totals, whose rewards differ little, weigh as
        # much as the high totals, whose busts dominate the raw reward spread.
        grpo=GRPOConfig(steps=300, prompts_per_step=16, group_size=8, advantage="mean_std", max_turns=8),
        # Next-token prediction on transcripts of random legal play: the tiny model learns to read
        # the cards and to answer `hit`/`stand`; the replies are random, never the strategy.
        warmup=WarmupConfig(sft_steps=100, sft_batch_size=64, sft_lr=3e-3, tokens="all"),
        engine=BuiltinEngineConfig(max_batch_size=128),
        eval=EvalConfig(num_episodes=10_000, every_steps=100, num_episodes_during=1_000),
    )


def evaluate(parts: LoopParts, cfg: RunConfig, num_hands: int, greedy: bool) -> float:
    """Mean return on the first `num_hands` fixed evaluation hands (see `common.play_policy`)."""
    rollouts = play_policy(parts, cfg, episode_seeds(num_hands, cfg.eval.seed), greedy)
    return statistics.fmean(r.reward for r in rollouts)


def evaluate_both(parts: LoopParts, cfg: RunConfig, num_hands: int) -> dict[str, float]:
    return {
        "return_greedy": evaluate(parts, cfg, num_hands, greedy=True),
        "return": evaluate(parts, cfg, num_hands, greedy=False),
    }


def main(cfg: RunConfig) -> dict:
    run = run_recipe(cfg, evaluate_both)
    basic = statistics.fmean(
        play_hands(basic_strategy_policy, episode_seeds(cfg.eval.num_episodes, cfg.eval.seed))
    )
    summary = build_summary(
        run, {"eval_hands": cfg.eval.num_episodes}, {"return_basic_strategy": round(basic, 4)}
    )
    return finish(run, summary)
