"""A single-turn task with a programmatic reward: how many letters does a word have?

The warm-up's scripted replies are random numbers in the words' range: the reply format, never the count.

inflight run examples/letter_count.py
"""

import random

from inflight.config import EvalConfig, GRPOConfig, RunConfig, SamplingConfig, WarmupConfig
from inflight.rollouts.api import RolloutContext
from inflight.trainer import TrainerConfig
from inflight.types import Rollout

MIN_LETTERS, MAX_LETTERS = 2, 9


def load_problems(split: str) -> list[dict]:
    """Made-up words; the test split's come from another seed, so they are held out."""
    rng = random.Random(0 if split == "train" else 1)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ("".join(rng.choices(letters, k=rng.randint(MIN_LETTERS, MAX_LETTERS))) for _ in range(1000))
    return [{"word": word} for word in words]


async def generate_rollout(ctx: RolloutContext, problem: dict) -> Rollout:
    chat = ctx.chat()
    chat.user(f"How many letters are in the word {problem['word']}? Reply with a number.")
    reply = (await chat.assistant()).strip()
    answer = len(problem["word"])
    error = abs(int(reply) - answer) if reply.isdigit() else None
    reward = 0.0 if error is None else 1.0 / (1 + error)  # partial credit for near misses
    return chat.to_rollout(reward, {"correct": float(error == 0), "format_error": float(error is None)})


def warmup_reply(transcript: str, rng: random.Random) -> str:
    """A number, whatever the word: a model from scratch learns to answer with one (it never outputs a digit
    before), and RL which one."""
    return str(rng.randint(MIN_LETTERS, MAX_LETTERS))


def preset() -> RunConfig:
    return RunConfig(
        # At the default lr (1e-4) the tiny model barely moved: greedy return 0.33 -> 0.43 in 100 steps,
        # against 0.33 -> 0.55-0.61 here (2-core CPU).
        trainer=TrainerConfig(lr=1e-3),
        sampling=SamplingConfig(max_tokens_per_turn=4),
        grpo=GRPOConfig(steps=100, prompts_per_step=16, group_size=8, advantage="mean_std", max_turns=1),
        warmup=WarmupConfig(sft_steps=20, sft_batch_size=32, sft_lr=3e-3),
        eval=EvalConfig(num_episodes=200, every_steps=25, num_episodes_during=100),
    )
