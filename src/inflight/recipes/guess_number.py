"""Guess the number: a multi-turn task written with the rollout API (`load_problems`, `generate_rollout`).

The policy guesses an integer in 1..1024; after each guess the user says "higher" or "lower". Reward
(shaped): the information the guesses gained, 1 - log2(numbers still possible) / 10, in [0, 1], plus 1
for finding the number; an unparseable guess ends the episode with reward -0.5 (counted). Bisection
finds any number in 10 guesses; the recipe runs in the asynchronous pipeline (`mode=async`).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import statistics
import time
from typing import Any

from inflight.config import EvalConfig, GRPOConfig, PipelineConfig, RunConfig, SamplingConfig, WarmupConfig
from inflight.inference.builtin import BuiltinEngineConfig
from inflight.inference.engine_loop import EngineLoop
from inflight.metrics.logger import MetricsLogger
from inflight.metrics.plot import plot_run
from inflight.orchestrator.setup import build_engine, build_trainer, load_policy, make_run_dir, pad_id
from inflight.orchestrator.task_warmup import task_warmup
from inflight.rollouts.api import RolloutContext, scripted_policy
from inflight.rollouts.chat import ChatFormat
from inflight.trainer import LossConfig, TrainerConfig
from inflight.trainer.checkpoint import checkpoint_step, find_checkpoint
from inflight.types import Rollout, SamplingParams

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
    for _ in range(MAX_GUESSES):
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


class GuessNumberTask:
    """The task as the pipeline sees it: problem k cycles through the training targets."""

    def __init__(self, split: str = "train") -> None:
        self.problems = load_problems(split)

    def problem(self, k: int) -> dict[str, Any]:
        return {**self.problems[k % len(self.problems)], "group_id": str(k)}

    async def generate_rollout(self, ctx: RolloutContext, problem: dict[str, Any]) -> Rollout:
        return await generate_rollout(ctx, problem)


def consistent_guesser(seed: int):
    """Warm-up replies: a uniformly random number still consistent with the feedback so far.

    Legal play that uses the feedback, never bisection (what RL should discover).
    """
    rng = random.Random(seed)

    def reply(transcript: str) -> str:
        lo, hi = LOW, HIGH
        for guess, direction in re.findall(r"(\d+) is too (low|high)", transcript):
            if direction == "low":
                lo = max(lo, int(guess) + 1)
            else:
                hi = min(hi, int(guess) - 1)
        return str(rng.randint(lo, max(lo, hi)))

    return reply


def preset() -> RunConfig:
    return RunConfig(
        recipe="guess_number",
        mode="async",
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
        engine=BuiltinEngineConfig(max_batch_size=128, max_seq_len_tokens=512),
        eval=EvalConfig(num_episodes=256, every_steps=0),
        pipeline=PipelineConfig(max_staleness_steps=2, max_groups_in_flight=16),
        checkpoint_every_steps=10,
    )


def evaluate(engine: Any, chat: ChatFormat, cfg: RunConfig, num_problems: int) -> dict[str, float]:
    """Greedy play on the first test targets; `engine` is a BuiltinEngine not driven by anyone else."""
    problems = load_problems("test")[:num_problems]
    loop = EngineLoop(engine).start()
    params = SamplingParams(max_tokens=cfg.sampling.max_tokens_per_turn, temperature=0.0)

    async def play() -> list[Rollout]:
        async def gen(request: Any) -> Any:
            return await loop.generate(request, 600.0)

        ctxs = [RolloutContext(gen, chat, params, str(i), i, 0, None, cfg) for i in range(len(problems))]
        return list(
            await asyncio.gather(*(generate_rollout(c, p) for c, p in zip(ctxs, problems, strict=True)))
        )

    try:
        rollouts = asyncio.run(play())
    finally:
        loop.stop()
    return {
        "return": statistics.fmean(r.reward for r in rollouts),
        "found_frac": statistics.fmean(r.metrics["found"] for r in rollouts),
        "format_error_frac": statistics.fmean(r.metrics["format_errors"] for r in rollouts),
        "guesses_mean": statistics.fmean(r.metrics["turns"] for r in rollouts),
    }


def main(cfg: RunConfig) -> dict:
    from inflight.orchestrator.pipeline import PipelineParts, run_pipeline

    t0 = time.perf_counter()
    run_dir = make_run_dir(cfg)
    logger = MetricsLogger(run_dir)
    model, tokenizer = load_policy(cfg)
    chat = ChatFormat.for_model(tokenizer, model)
    task = GuessNumberTask("train")
    resuming = find_checkpoint(run_dir / "checkpoint") is not None
    first_step = checkpoint_step(run_dir / "checkpoint")  # the summary counts the steps before a resume
    if cfg.warmup.sft_steps and not resuming:
        task_warmup(
            model,
            pad_id(tokenizer),
            task,
            chat,
            lambda s: scripted_policy(chat, consistent_guesser(s)),
            cfg,
            logger,
        )
    trainer = build_trainer(model, tokenizer, cfg.trainer, cfg.grpo.steps)
    engine = build_engine(cfg, model, tokenizer)
    initial = evaluate(engine, chat, cfg, cfg.eval.num_episodes)
    logger.log(0, initial, phase="eval")
    history = run_pipeline(PipelineParts(engine, trainer, chat, task), cfg, logger, run_dir)
    final = evaluate(engine, chat, cfg, cfg.eval.num_episodes)
    logger.log(cfg.grpo.steps, final, phase="eval")
    rewards = [h["reward_mean"] for h in history]
    tenth = max(1, len(rewards) // 10)
    summary = {
        "recipe": cfg.recipe,
        "mode": cfg.mode,
        "steps": first_step + len(history),
        "wall_s": round(time.perf_counter() - t0, 1),
        "eval_problems": cfg.eval.num_episodes,
        "return_initial": round(initial["return"], 4),
        "return_final": round(final["return"], 4),
        "found_frac_initial": round(initial["found_frac"], 4),
        "found_frac_final": round(final["found_frac"], 4),
        "return_first10": round(statistics.fmean(rewards[:tenth]), 4) if rewards else None,
        "return_last10": round(statistics.fmean(rewards[-tenth:]), 4) if rewards else None,
        "run_dir": str(run_dir),
    }
    logger.log(cfg.grpo.steps, summary, phase="summary")
    logger.close()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_run(run_dir)
    return summary
