"""Math on the tiny model: the in-repo problem set, answers checked with math-verify.

Trains on the set's train split and evaluates on its held-out test split (12 problems, each asked
`eval.num_episodes / 12` times). The warm-up's replies are boxed answers of *other* problems, so it
teaches the `\\boxed{}` format and nothing about any problem. A 1.5M-parameter model from scratch
does not learn this task; the recipe shows the pipeline end to end (docs/benchmarks.md).
"""

from __future__ import annotations

from inflight.config import EnvConfig, EvalConfig, GRPOConfig, RunConfig, SamplingConfig, WarmupConfig
from inflight.envs import make_env
from inflight.envs.base import Environment
from inflight.inference.builtin import BuiltinEngineConfig
from inflight.orchestrator.sync_loop import LoopParts
from inflight.recipes.common import (
    build_summary,
    finish,
    greedy_and_sampled,
    rate_summary,
    run_recipe,
    tiny_model_loss,
)
from inflight.trainer import TrainerConfig

EVAL_KEYS = ("correct", "format_error")


def preset() -> RunConfig:
    return RunConfig(
        recipe="math",
        env=EnvConfig(name="math", kwargs={"split": "train"}),
        trainer=TrainerConfig(
            lr=1e-3,
            micro_batch_size=32,
            loss=tiny_model_loss(entropy_coef=0.1),
        ),
        sampling=SamplingConfig(temperature=1.0, max_tokens_per_turn=24),
        grpo=GRPOConfig(steps=100, prompts_per_step=12, group_size=8, advantage="mean_std", max_turns=1),
        warmup=WarmupConfig(sft_steps=100, sft_batch_size=64, sft_lr=3e-3, tokens="all"),
        engine=BuiltinEngineConfig(max_batch_size=128, max_seq_len_tokens=128),
        eval=EvalConfig(num_episodes=96, every_steps=25, num_episodes_during=48),
    )


def evaluate(parts: LoopParts, cfg: RunConfig, num_episodes: int) -> dict[str, float]:
    """Return and accuracy on the test split: seed i asks test problem i mod 12."""

    def test_env() -> Environment:
        return make_env(cfg.env.name, **(cfg.env.kwargs | {"split": "test"}))

    return greedy_and_sampled(parts, cfg, range(num_episodes), EVAL_KEYS, make_env=test_env)


def main(cfg: RunConfig) -> dict:
    run = run_recipe(cfg, evaluate)
    extra = rate_summary(run, "correct", "accuracy")
    extra["format_error_final_sampled"] = round(run.final["format_error"], 4)
    return finish(run, build_summary(run, {"eval_episodes": cfg.eval.num_episodes}, extra))
