"""The task of `inflight bench trl`, shared word for word by both sides: its prompts and its reward.

Standard library only: the TRL side imports this file inside its own environment, where inflight is not
installed. A prompt asks for digits; the reward is the digits in the reply over the token budget, capped
at 1, so a model with random weights already earns a graded reward (a few digits by chance) and GRPO has
signal from the first step, and no reply gains by ending early (every completion tends to fill its
budget, the shape the benchmark is meant to measure).
"""

from __future__ import annotations

DIGITS_PER_FULL_REWARD = 32  # the generation budget, in tokens: a reply of 32 digits or more earns 1


def prompt(k: int) -> str:
    """The user message of problem k (k = step * prompts_per_step + i, the same order on both sides)."""
    return f"Task {k}: write as many digits as you can."


def reward(reply: str) -> float:
    """Digit characters in the reply (its text without the stop token) / 32, capped at 1."""
    return min(1.0, sum(ch.isdigit() for ch in reply) / DIGITS_PER_FULL_REWARD)
