"""Math on the tiny model: the in-repo problem set, answers checked with math-verify.

A task written as an Env (`MathEnv`), trained on the set's train split and evaluated on its held-out test
split (12 problems, drawn `eval.num_episodes` times). The warm-up's replies are boxed answers of *other*
problems (the env's `warmup_reply`), so it teaches the `\\boxed{}` format and nothing about any problem.
A 1.5M-parameter model from scratch does not learn this task; the recipe shows the pipeline end to end
(docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

from inflight.config import EngineConfig, EvalConfig, GRPOConfig, RunConfig, SamplingConfig, WarmupConfig
from inflight.envs.math import MathEnv
from inflight.recipes.common import rate_summary, tiny_model_loss
from inflight.trainer import TrainerConfig

make_env = MathEnv  # gets split="train" or "test" from the run; env.kwargs go to its constructor


def preset() -> RunConfig:
    return RunConfig(
        trainer=TrainerConfig(
            lr=1e-3,
            micro_batch_size=32,
            loss=tiny_model_loss(entropy_coef=0.1),
        ),
        sampling=SamplingConfig(temperature=1.0, max_tokens_per_turn=24),
        grpo=GRPOConfig(steps=100, prompts_per_step=12, group_size=8, advantage="mean_std", max_turns=1),
        warmup=WarmupConfig(sft_steps=100, sft_batch_size=64, sft_lr=3e-3, tokens="all"),
        engine=EngineConfig(max_batch_size=128, max_seq_len_tokens=128),
        eval=EvalConfig(num_episodes=96, every_steps=25, num_episodes_during=48),
    )


def summarize(cfg: RunConfig, initial: dict[str, float], final: dict[str, float]) -> dict[str, Any]:
    return {
        **rate_summary(initial, final, "correct", "accuracy"),
        "format_error_final_sampled": round(final.get("format_error", 0.0), 4),
    }
