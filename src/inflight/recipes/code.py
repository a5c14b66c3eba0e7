"""Code on the tiny model: write a Python function; reward = the fraction of its unit tests passed, each
test run in the sandbox (`envs/code.py`, `envs/sandbox/`).

The warm-up's replies are reference solutions of *other* problems renamed to this problem's function,
in a ```python block: the reply format, a real function definition, and nothing about this problem.
Evaluation samples problems of the same set as training (it has no held-out split). A 1.5M-parameter
model from scratch does not learn to program; the recipe shows the pipeline end to end.
"""

from __future__ import annotations

import random
import re

from inflight.config import EnvConfig, EvalConfig, GRPOConfig, RunConfig, SamplingConfig, WarmupConfig
from inflight.envs.base import episode_seeds
from inflight.envs.code import CodeObservation, load_problems
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

EVAL_KEYS = ("solved", "format_error", "tests_passed")


def preset() -> RunConfig:
    return RunConfig(
        recipe="code",
        env=EnvConfig(name="code"),
        trainer=TrainerConfig(
            lr=1e-3,
            micro_batch_size=16,
            loss=tiny_model_loss(entropy_coef=0.1),
        ),
        sampling=SamplingConfig(temperature=1.0, max_tokens_per_turn=96),
        grpo=GRPOConfig(steps=40, prompts_per_step=8, group_size=4, advantage="mean_std", max_turns=1),
        # Every warm-up reply is real code whose tests run in the sandbox (~4 executions a reply): a
        # smaller warm-up than the other recipes' keeps it to a few minutes on 2 cores.
        warmup=WarmupConfig(sft_steps=60, sft_batch_size=16, sft_lr=3e-3, tokens="all"),
        engine=BuiltinEngineConfig(max_batch_size=64, max_seq_len_tokens=256),
        eval=EvalConfig(num_episodes=64, every_steps=20, num_episodes_during=32),
    )


def other_solution_reply(obs: CodeObservation, rng: random.Random) -> str:
    """Warm-up reply: another problem's reference solution under this problem's function name."""
    problems = load_problems()
    other = rng.choice([p for p in problems if p.id != obs.problem_id] or list(problems))
    code = re.sub(rf"\b{re.escape(other.entry_point)}\b", obs.entry_point, other.solution)
    return f"```python\n{code.rstrip()}\n```"


def evaluate(parts: LoopParts, cfg: RunConfig, num_episodes: int) -> dict[str, float]:
    """Mean fraction of tests passed (return), solved rate and format errors on fixed problem draws."""
    return greedy_and_sampled(parts, cfg, episode_seeds(num_episodes, cfg.eval.seed), EVAL_KEYS)


def main(cfg: RunConfig) -> dict:
    run = run_recipe(cfg, evaluate, warmup_reply=other_solution_reply)
    extra = rate_summary(run, "solved", "solved")
    extra["format_error_final_sampled"] = round(run.final["format_error"], 4)
    return finish(run, build_summary(run, {"eval_episodes": cfg.eval.num_episodes}, extra))
