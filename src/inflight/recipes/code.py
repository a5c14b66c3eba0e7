"""Code on the tiny model: write a Python function; reward = the fraction of its unit tests passed, each
test run in the sandbox (`envs/code.py`, `envs/sandbox/`).

A task written as an Env (`CodeEnv`), trained on the problem set's train split and evaluated on its
held-out test split (every fifth problem). The warm-up's replies are reference solutions of *other* train
problems renamed to this problem's function, in a ```python block: the reply format, a real function
definition, and nothing about this problem (nor any test problem). A 1.5M-parameter model from scratch does
not learn to program; the recipe shows the pipeline end to end.
"""

from __future__ import annotations

import random
import re
from typing import Any

from inflight.config import EngineConfig, EvalConfig, GRPOConfig, RunConfig, SamplingConfig, WarmupConfig
from inflight.envs.code import CodeEnv, CodeObservation, load_problems
from inflight.recipes.common import rate_summary, tiny_model_loss
from inflight.trainer import TrainerConfig

make_env = CodeEnv  # gets split="train" or "test" from the run; env.kwargs (limits, ...) go to it


def preset() -> RunConfig:
    return RunConfig(
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
        engine=EngineConfig(max_batch_size=64, max_seq_len_tokens=256),
        eval=EvalConfig(num_episodes=64, every_steps=20, num_episodes_during=32),
    )


def warmup_reply(obs: CodeObservation, rng: random.Random) -> str:
    """Another train problem's reference solution under this problem's function name."""
    train = [p for p in load_problems() if p.split == "train"]
    other = rng.choice([p for p in train if p.id != obs.problem_id] or train)
    code = re.sub(rf"\b{re.escape(other.entry_point)}\b", obs.entry_point, other.solution)
    return f"```python\n{code.rstrip()}\n```"


def summarize(cfg: RunConfig, initial: dict[str, float], final: dict[str, float]) -> dict[str, Any]:
    return {
        **rate_summary(initial, final, "solved", "solved"),
        "format_error_final_sampled": round(final.get("format_error", 0.0), 4),
    }
