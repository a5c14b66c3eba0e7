"""Guess the number: a multi-turn task written with the rollout API (`load_problems`, `generate_rollout`).

The policy guesses an integer in 1..1024; after each guess the user says "higher" or "lower". Reward
(shaped): the information the guesses gained, 1 - log2(numbers still possible) / 10, in [0, 1], plus 1
for finding the number; an unparseable guess ends the episode with reward -0.5 (counted). Bisection
finds any number in 10 guesses. The warm-up's replies are random numbers consistent with the feedback
(`warmup_reply`), never bisection.
"""

from __future__ import annotations

import math
import random
import re
from typing import Any

from inflight.config import (
    EngineConfig,
    EvalConfig,
    GRPOConfig,
    PipelineConfig,
    RunConfig,
    SamplingConfig,
    WarmupConfig,
)
from inflight.rollouts.api import RolloutContext
from inflight.trainer import LossConfig, TrainerConfig
from inflight.types import Rollout

LOW, HIGH = 1, 1024
MAX_GUESSES = 12
FORMAT_PENALTY = -0.5
INTRO = f"I am thinking of a number from {LOW} to {HIGH}. Guess it: reply with one number."
_NUMBER = re.compile(r"^\s*(\d{1,5})\s*$")


def load_problems(split: str) -> list[dict[str, Any]]:
    """Train and test targets come from different seeds; deterministic."""
    if split not in ("train", "test"):
        raise ValueError(f"guess_number has splits 'train' and 'test', not {split!r}")
    rng = random.Random(0 if split == "train" else 1)
    return [{"target": rng.randint(LOW, HIGH)} for _ in range(4096 if split == "train" else 512)]


def feedback(guess: int, target: int) -> str:
    return f"{guess} is too low. Higher." if guess < target else f"{guess} is too high. Lower."


def shaped_reward(lo: int, hi: int, found: bool) -> float:
    """1 - log2(hi - lo + 1) / 10 for the numbers still possible, +1 when found."""
    return (1.0 - math.log2(hi - lo + 1) / math.log2(HIGH - LOW + 1)) + (1.0 if found else 0.0)


async def generate_rollout(ctx: RolloutContext, problem: dict[str, Any]) -> Rollout:
    target = int(problem["target"])
    chat = ctx.chat()
    chat.user(INTRO)
    lo, hi, found, format_errors = LOW, HIGH, False, 0
    # grpo.max_turns (its preset: MAX_GUESSES) may shorten the game, never lengthen it.
    for _ in range(min(MAX_GUESSES, ctx.max_turns or MAX_GUESSES)):
        match = _NUMBER.match(await chat.assistant())
        if match is None:
            format_errors = 1
            break
        guess = int(match.group(1))
        if guess == target:
            found, lo, hi = True, target, target
            break
        if guess < target:
            lo = max(lo, guess + 1)
        else:
            hi = min(hi, guess - 1)
        chat.user(feedback(guess, target))
    reward = FORMAT_PENALTY if format_errors else shaped_reward(lo, hi, found)
    return chat.to_rollout(reward, {"found": float(found), "format_errors": float(format_errors)})


def warmup_reply(transcript: str, rng: random.Random) -> str:
    """A uniformly random number still consistent with the feedback in the transcript so far: legal play
    that uses the feedback, never bisection (what RL should discover)."""
    lo, hi = LOW, HIGH
    for guess, direction in re.findall(r"(\d+) is too (low|high)", transcript):
        if direction == "low":
            lo = max(lo, int(guess) + 1)
        else:
            hi = min(hi, int(guess) - 1)
    return str(rng.randint(lo, max(lo, hi)))


def preset() -> RunConfig:
    return RunConfig(
        trainer=TrainerConfig(
            lr=3e-4,
            micro_batch_size=32,
            loss=LossConfig(name="ppo", reduction="token_mean", entropy_coef=0.1, entropy_top_k=8),
        ),
        sampling=SamplingConfig(temperature=1.0, max_tokens_per_turn=6),
        grpo=GRPOConfig(
            steps=100, prompts_per_step=8, group_size=8, advantage="mean_std", max_turns=MAX_GUESSES
        ),
        warmup=WarmupConfig(sft_steps=150, sft_batch_size=32, sft_lr=3e-3, tokens="all"),
        engine=EngineConfig(max_batch_size=128, max_seq_len_tokens=512),
        eval=EvalConfig(num_episodes=256, every_steps=0),
        pipeline=PipelineConfig(max_staleness_steps=2, max_groups_in_flight=16),
        checkpoint_every_steps=10,
    )


def summarize(cfg: RunConfig, initial: dict[str, float], final: dict[str, float]) -> dict[str, Any]:
    """How often greedy play finds the number, before and after RL."""
    return {
        "found_frac_initial": round(initial.get("found_greedy", 0.0), 4),
        "found_frac_final": round(final.get("found_greedy", 0.0), 4),
    }
