"""Tools on the tiny model: multi-turn episodes where the policy may run Python in the sandbox
(`<python>CODE</python>`, its stdout/stderr come back as the next user turn) before it answers
(`<answer>TEXT</answer>`). Tool output is environment text: masked out of the loss like every env turn.

A task written as an Env (`ToolsEnv`: one seeded task per episode). The warm-up's scripts call the tool
once with an *unrelated* computation and then answer with what it printed: the protocol (call, read the
output, answer), nothing about the task. A 1.5M-parameter model from scratch does not learn to solve
these tasks; the recipe shows multi-turn RL with tools end to end.
"""

from __future__ import annotations

import random
import re
from typing import Any

from inflight.config import (
    EngineConfig,
    EnvConfig,
    EvalConfig,
    GRPOConfig,
    RunConfig,
    SamplingConfig,
    WarmupConfig,
)
from inflight.envs.tools import ToolsEnv, ToolsObservation
from inflight.recipes.common import rate_summary, tiny_model_loss
from inflight.trainer import TrainerConfig

make_env = ToolsEnv  # env.kwargs (max_tool_calls, kinds, ...) go to its constructor
_OUTPUT = re.compile(r"<output>\n(.*?)\n?</output>", re.DOTALL)


def preset() -> RunConfig:
    return RunConfig(
        env=EnvConfig(kwargs={"max_tool_calls": 2}),
        trainer=TrainerConfig(
            lr=1e-3,
            micro_batch_size=16,
            loss=tiny_model_loss(entropy_coef=0.1),
        ),
        sampling=SamplingConfig(temperature=1.0, max_tokens_per_turn=32),
        # max_turns = tool calls + the answer.
        grpo=GRPOConfig(steps=40, prompts_per_step=8, group_size=4, advantage="mean_std", max_turns=3),
        # Teaches the protocol (call, read the output, answer): after 100 steps 11% of sampled episodes
        # break it, after 60 steps 41%.
        warmup=WarmupConfig(sft_steps=100, sft_batch_size=32, sft_lr=3e-3, tokens="all"),
        # Room for the longest task prompt (~250 tokens), three replies and two tool outputs (each cut
        # to 1,000 characters by the env).
        engine=EngineConfig(max_batch_size=32, max_seq_len_tokens=1536),
        eval=EvalConfig(num_episodes=64, every_steps=20, num_episodes_during=32),
    )


def warmup_reply(obs: ToolsObservation, rng: random.Random) -> str:
    """First a tool call computing a random product, then the printed value as the answer."""
    if obs.tool_output is None and obs.tool_calls_left > 0:
        return f"<python>print({rng.randint(2, 999)} * {rng.randint(2, 999)})</python>"
    printed = _OUTPUT.search(obs.tool_output or "")
    value = printed.group(1).strip() if printed else ""
    return f"<answer>{value or rng.randint(0, 999)}</answer>"


def summarize(cfg: RunConfig, initial: dict[str, float], final: dict[str, float]) -> dict[str, Any]:
    return {
        **rate_summary(initial, final, "correct", "accuracy"),
        "format_error_final_sampled": round(final.get("format_error", 0.0), 4),
        "tool_calls_final_sampled": round(final.get("tool_calls", 0.0), 4),
    }
