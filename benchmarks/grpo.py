"""`inflight bench grpo`: completions/s of the on-policy sync loop on the tiny model.

Shape: 8 prompts x 8 samples x 32 generated tokens per step (a single-turn task whose reward is the
number of distinct characters in the reply, so every completion runs to its token budget and the
loop does real training work). Throughput counts the whole step: sampling, training and weight sync.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

import torch

from benchmarks import at_least
from inflight.config import GRPOConfig, RunConfig, SamplingConfig
from inflight.envs.base import Environment, State, TextAction, TextObservation
from inflight.metrics.logger import MetricsLogger
from inflight.orchestrator.setup import build_engine, build_trainer, load_policy
from inflight.orchestrator.sync_loop import LoopParts, train
from inflight.orchestrator.task import env_task, load_split
from inflight.preflight import check_model_dir
from inflight.rollouts.chat import ChatFormat
from inflight.trainer import LossConfig, TrainerConfig


class DistinctCharsEnv(Environment[TextAction, TextObservation, State]):
    """One turn: reward = distinct characters in the reply / 10. Cheap, so the loop's cost dominates."""

    def __init__(self) -> None:
        self._state = State()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> TextObservation:
        self._state = State(episode_id=episode_id)
        return TextObservation(prompt=f"Write anything ({seed}).")

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs: Any) -> TextObservation:
        self._state.step_count += 1
        return TextObservation(prompt="", done=True, reward=len(set(action.text)) / 10)

    @property
    def state(self) -> State:
        return self._state


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="inflight bench grpo", description=__doc__)
    parser.add_argument(
        "--prompts", type=at_least(1), default=8, help="prompts per step (default %(default)s)"
    )
    parser.add_argument(
        "--samples", type=at_least(2), default=8, help="samples per prompt, the group (default %(default)s)"
    )
    parser.add_argument(
        "--new-tokens",
        type=at_least(1),
        default=32,
        help="generated tokens per sample; every reply runs to it (default %(default)s)",
    )
    parser.add_argument(
        "--steps", type=at_least(1), default=5, help="measured steps (after one warm-up step)"
    )
    parser.add_argument("--model", default=None, help="model dir or hub id (default: the tiny preset)")
    args = parser.parse_args(argv)
    if args.model:
        check_model_dir(args.model)  # what `inflight run` checks: one line for a path that holds no model

    with tempfile.TemporaryDirectory(prefix="inflight-bench-grpo-") as tmp:
        cfg = RunConfig(
            recipe="bench-grpo",
            run_dir=tmp,
            progress=False,
            trainer=TrainerConfig(lr=1e-4, micro_batch_size=64, loss=LossConfig(name="ppo")),
            sampling=SamplingConfig(max_tokens_per_turn=args.new_tokens),
            grpo=GRPOConfig(steps=1, prompts_per_step=args.prompts, group_size=args.samples, max_turns=1),
        )
        if args.model:
            cfg.model.path = args.model
        model, tokenizer = load_policy(cfg)
        # A reply may end early with <|im_end|>; the tokens actually generated are reported beside.
        task = env_task("bench-grpo", DistinctCharsEnv)
        parts = LoopParts(
            build_engine(cfg, model, tokenizer),
            build_trainer(model, tokenizer, cfg.trainer),
            ChatFormat(tokenizer),
            task,
            load_split(task, "train"),
        )
        logger = MetricsLogger(tmp)
        train(parts, cfg, logger, tmp)  # warm-up step
        cfg.grpo.steps = args.steps
        t0 = time.perf_counter()
        history = train(parts, cfg, logger, tmp)
        wall = time.perf_counter() - t0
    completions = args.steps * args.prompts * args.samples
    gen_tokens = sum(h["generated_tokens"] for h in history)
    result = {
        "benchmark": "grpo",
        "completions_per_s": round(completions / wall, 2),
        "generated_tokens_per_s": round(gen_tokens / wall, 1),
        "mean_generated_tokens": round(gen_tokens / completions, 2),
        "step_s": round(wall / args.steps, 3),
        "sample_s_mean": round(sum(h["sample_s"] for h in history) / args.steps, 3),
        "train_s_mean": round(sum(h.get("train_s", 0.0) for h in history) / args.steps, 3),
        "shape": f"{args.prompts}x{args.samples}x{args.new_tokens}",
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result))
    return result
