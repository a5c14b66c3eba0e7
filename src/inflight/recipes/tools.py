"""Tools on the tiny model: multi-turn episodes where the policy may run Python in the sandbox
(`<python>CODE</python>`, its stdout/stderr come back as the next user turn) before it answers
(`<answer>TEXT</answer>`). Tool output is environment text: masked out of the loss like every env turn.

The warm-up's scripts call the tool once with an *unrelated* computation and then answer with what it
printed: the protocol (call, read the output, answer), nothing about the task. A 1.5M-parameter model
from scratch does not learn to solve these tasks; the recipe shows multi-turn RL with tools end to end.
"""

from __future__ import annotations

import random
import re

from inflight.config import EnvConfig, EvalConfig, GRPOConfig, RunConfig, SamplingConfig, WarmupConfig
from inflight.envs.base import episode_seeds
from inflight.envs.tools import ToolsObservation
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

EVAL_KEYS = ("correct", "format_error", "tool_calls")
_OUTPUT = re.compile(r"<output>\n(.*?)\n?</output>", re.DOTALL)


def preset() -> RunConfig:
    return RunConfig(
        recipe="tools",
        env=EnvConfig(name="tools", kwargs={"max_tool_calls": 2}),
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
        engine=BuiltinEngineConfig(max_batch_size=32, max_seq_len_tokens=1536),
        eval=EvalConfig(num_episodes=64, every_steps=20, num_episodes_during=32),
    )


def unrelated_tool_reply(obs: ToolsObservation, rng: random.Random) -> str:
    """Warm-up reply: first a tool call computing a random product, then the printed value as the answer."""
    if obs.tool_output is None and obs.tool_calls_left > 0:
        return f"<python>print({rng.randint(2, 999)} * {rng.randint(2, 999)})</python>"
    printed = _OUTPUT.search(obs.tool_output or "")
    value = printed.group(1).strip() if printed else ""
    return f"<answer>{value or rng.randint(0, 999)}</answer>"


def evaluate(parts: LoopParts, cfg: RunConfig, num_episodes: int) -> dict[str, float]:
    """Return (1 for an exact answer), accuracy, format errors and tool calls on fixed tasks."""
    return greedy_and_sampled(parts, cfg, episode_seeds(num_episodes, cfg.eval.seed), EVAL_KEYS)


def main(cfg: RunConfig) -> dict:
    run = run_recipe(cfg, evaluate, warmup_reply=unrelated_tool_reply)
    extra = rate_summary(run, "correct", "accuracy")
    extra["format_error_final_sampled"] = round(run.final["format_error"], 4)
    extra["tool_calls_final_sampled"] = round(run.final["tool_calls"], 4)
    return finish(run, build_summary(run, {"eval_episodes": cfg.eval.num_episodes}, extra))
