"""A single-turn task with a programmatic reward: how many letters does a word have?

inflight run examples/letter_count.py
"""

import random

from inflight.config import EvalConfig, GRPOConfig, RunConfig, SamplingConfig
from inflight.rollouts.api import RolloutContext
from inflight.types import Rollout


def load_problems(split: str) -> list[dict]:
    """Made-up words; the test split's come from another seed, so they are held out."""
    rng = random.Random(0 if split == "train" else 1)
    words = ("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(1000))
    return [{"word": word} for word in words]


async def generate_rollout(ctx: RolloutContext, problem: dict) -> Rollout:
    chat = ctx.chat()
    chat.user(f"How many letters are in the word {problem['word']}? Reply with a number.")
    reply = (await chat.assistant()).strip()
    answer = len(problem["word"])
    error = abs(int(reply) - answer) if reply.isdigit() else None
    reward = 0.0 if error is None else 1.0 / (1 + error)  # partial credit for near misses
    return chat.to_rollout(reward, {"correct": float(error == 0), "format_error": float(error is None)})


def preset() -> RunConfig:
    return RunConfig(
        sampling=SamplingConfig(max_tokens_per_turn=4),
        grpo=GRPOConfig(steps=100, prompts_per_step=16, group_size=8, advantage="mean_std", max_turns=1),
        eval=EvalConfig(num_episodes=200, every_steps=25, num_episodes_during=100),
    )
