"""`inflight bench pipeline`: the asynchronous pipeline against synchronous training, side by side.

(a) BlackJack (the `make run` recipe's settings, after its warm-up): the sync loop
    (`orchestrator/sync_loop.py`, both cores on each phase) against the pipeline (`mode=async`,
    max_staleness_steps=2, one core for the engine thread here and one for the trainer, in a process
    of its own by default: `pipeline.trainer_process`).
(b) A latency task: 3 turns per episode, each environment reply taking 50-500 ms (uniform, an
    asyncio sleep standing for a remote environment or a tool), and long-tailed completion lengths
    (max_tokens per turn drawn from a Pareto law, 4..96). Its "sync" side is the same pipeline with
    max_staleness_steps=0: rollouts of a step still run concurrently, but generation and training
    never overlap (the sync loop itself would play the environments' latencies one after another,
    which would flatter the async side).

(c) Only with `--only ray` (needs `inflight[ray]`): BlackJack through `launcher=ray` (a private local Ray:
    one engine replica actor serving HTTP, and the run's actor) against the local launcher, the same
    configuration without evaluation; `ratio_ray_vs_local` (issue 13's goal: >= 0.7). With
    `--rollout-workers N` the Ray side plays its groups in N rollout worker actors
    (`ray.num_rollout_workers`; the replica's and the workers' bundles share one logical CPU).

Both sides of a pair start from the same weights and run the same number of steps; completions/s
counts the trained rollouts over the wall time, and "reward after equal wall time" is each side's
mean training reward over its last 5 steps finished before the faster side's end. A trainer process's
start (a few seconds, once per run, hidden behind a run's first evaluation) is not timed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks import at_least
from inflight.config import GRPOConfig, PipelineConfig, RunConfig, SamplingConfig
from inflight.metrics.logger import MetricsLogger
from inflight.orchestrator.pipeline import run_pipeline
from inflight.orchestrator.run import train
from inflight.orchestrator.setup import build_engine, build_loop_trainer, load_policy, pad_id
from inflight.orchestrator.sync_loop import LoopParts
from inflight.orchestrator.target import resolve_target
from inflight.orchestrator.task import Task, load_split
from inflight.rollouts.api import RolloutContext
from inflight.rollouts.chat import ChatFormat
from inflight.trainer import LossConfig, TrainerConfig
from inflight.trainer.process import StepTrainer, TrainerProcess
from inflight.types import Rollout, SamplingParams


class LatencyTask:
    """3 turns; each environment reply takes 50-500 ms; reply lengths are long-tailed."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def load_problems(self, split: str) -> list[dict[str, Any]]:
        return [{"k": k} for k in range(10_000)]

    async def generate_rollout(self, ctx: RolloutContext, problem: dict[str, Any]) -> Rollout:
        rng = random.Random(hash((self.seed, problem["k"], ctx.sample_index)))
        chat = ctx.chat()
        chat.user(f"Task {problem['k']}: write digits.")
        digits = 0
        chars = 0
        for turn in range(3):
            max_tokens = min(96, int(4 * rng.paretovariate(1.2)))
            reply = await chat.assistant(SamplingParams(max_tokens=max_tokens, temperature=1.0))
            digits += sum(ch.isdigit() for ch in reply)
            chars += len(reply)
            await asyncio.sleep(rng.uniform(0.05, 0.5))  # the environment's latency
            if turn < 2:
                chat.user("Go on.")
        return chat.to_rollout(digits / max(chars, 1))


def _summary(history: list[dict[str, float]], wall_s: float, rollouts_per_step: int) -> dict[str, Any]:
    steps = len(history)
    out: dict[str, Any] = {
        "completions_per_s": round(steps * rollouts_per_step / wall_s, 2),
        "wall_s": round(wall_s, 1),
        "steps": steps,
        "reward_first5": round(statistics.fmean(h["reward_mean"] for h in history[:5]), 4),
    }
    keys = ("trainer_idle_frac", "engine_idle_frac", "weight_publish_s", "lag_steps_max", "train_s")
    # What each step trained: the work behind a step differs with the policy (uninformative groups skipped).
    keys += ("groups_uninformative_frac", "num_sequences", "num_tokens", "forward_tokens")
    for key in keys:
        values = [h[key] for h in history if key in h]
        if values:
            out[f"{key}_mean"] = round(statistics.fmean(values), 4)
    last = history[-1]
    for key in ("engine/update_pause_s_mean", "engine/update_pause_s_max", "engine/stale_kv_token_frac"):
        if key in last:  # the engine's counters since the start: the last step's value covers the run
            out[key.removeprefix("engine/")] = round(last[key], 5)
    lag = {k: round(statistics.fmean(h[k] for h in history), 4) for k in history[-1] if k.startswith("lag_")}
    if lag:
        out["lag"] = lag
    return out


def _reward_at(history: list[dict[str, float]], t_s: float) -> float:
    """Mean training reward of the last 5 steps that ended by t_s (step ends from cumulative step_s)."""
    ends, t = [], 0.0
    for h in history:
        t += h.get("step_s", 0.0) or h.get("sample_s", 0.0)
        ends.append(t)
    done = [h["reward_mean"] for h, end in zip(history, ends, strict=True) if end <= t_s] or [
        history[0]["reward_mean"]
    ]
    return round(statistics.fmean(done[-5:]), 4)


@contextlib.contextmanager
def _closing(trainer: StepTrainer) -> Iterator[None]:
    """Stops a TrainerProcess's child when its side is done (its start, a few seconds, is not timed)."""
    try:
        yield
    finally:
        if isinstance(trainer, TrainerProcess):
            trainer.close()


def _pair(results: dict[str, dict[str, Any]], histories: dict[str, list]) -> float:
    t_equal = min(r["wall_s"] for r in results.values())
    for mode, r in results.items():
        r["reward_at_equal_wall"] = _reward_at(histories[mode], t_equal)
    return round(results["async"]["completions_per_s"] / results["sync"]["completions_per_s"], 3)


def blackjack(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from inflight.orchestrator.warmup import format_warmup

    task = resolve_target("blackjack")
    cfg = task.config()
    cfg.progress = False
    cfg.warmup.sft_steps = args.warmup_steps
    cfg.grpo.steps = args.steps
    cfg.trainer.lr_schedule = "constant"  # as recorded in docs/benchmarks.md; the same on both sides
    model, tokenizer = load_policy(cfg)
    chat = ChatFormat(tokenizer)

    def new_env() -> Any:
        return task.make_env(cfg, "train")

    torch.set_num_threads(2)
    format_warmup(model, pad_id(tokenizer), chat, new_env, cfg, MetricsLogger(tmp / "warmup"))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    results, histories = {}, {}
    for mode in ("sync", "async"):
        model.load_state_dict(start)
        run_cfg = cfg.model_copy(deep=True)
        run_cfg.mode = mode
        run_cfg.pipeline.max_staleness_steps = args.max_staleness
        # Same work on both sides: uninformative groups are skipped, not re-drawn (the sync loop's rule).
        run_cfg.pipeline.active_sampling = False
        torch.set_num_threads(2)
        trainer = build_loop_trainer(run_cfg, model, tokenizer)  # async: a process of its own (default)
        parts = LoopParts(
            build_engine(run_cfg, model, tokenizer), trainer, chat, task, load_split(task, "train")
        )
        t0 = time.perf_counter()
        with _closing(trainer):
            histories[mode] = train(parts, run_cfg, MetricsLogger(tmp / f"bj-{mode}"), tmp / f"bj-{mode}")
        results[mode] = _summary(
            histories[mode], time.perf_counter() - t0, cfg.grpo.prompts_per_step * cfg.grpo.group_size
        )
    ratio = _pair(results, histories)
    return {"ratio": ratio, **results}


def latency_task(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    cfg = RunConfig(
        recipe="bench-latency",
        mode="async",
        progress=False,
        trainer=TrainerConfig(lr=1e-4, micro_batch_size=64, loss=LossConfig(name="ppo")),
        sampling=SamplingConfig(max_tokens_per_turn=32),
        grpo=GRPOConfig(steps=args.steps, prompts_per_step=8, group_size=8, advantage="mean_std"),
        pipeline=PipelineConfig(max_groups_in_flight=32),
    )
    model, tokenizer = load_policy(cfg)
    chat = ChatFormat(tokenizer)
    latency = LatencyTask()
    task = Task("bench-latency", latency.load_problems, latency.generate_rollout)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    results, histories = {}, {}
    for mode, staleness in (("sync", 0), ("async", args.max_staleness)):
        model.load_state_dict(start)
        run_cfg = cfg.model_copy(deep=True)
        run_cfg.pipeline.max_staleness_steps = staleness
        trainer = build_loop_trainer(run_cfg, model, tokenizer)
        parts = LoopParts(
            build_engine(run_cfg, model, tokenizer), trainer, chat, task, load_split(task, "train")
        )
        t0 = time.perf_counter()
        with _closing(trainer):
            histories[mode] = run_pipeline(
                parts, run_cfg, MetricsLogger(tmp / f"lat-{mode}"), tmp / f"lat-{mode}"
            )
        results[mode] = _summary(histories[mode], time.perf_counter() - t0, 64)
    ratio = _pair(results, histories)
    return {"ratio": ratio, **results}


def ray_pair(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """BlackJack through `launcher=ray` (a private local Ray: one engine replica actor and the run's actor)
    against the local launcher, the same configuration: completions/s over the steps after the second (the
    first two carry the replicas' first weight installs), from each run's own step times."""
    from inflight.launch.ray import run_on_ray
    from inflight.orchestrator.run import run

    task = resolve_target("blackjack")
    cfg = task.config()
    cfg.progress = False
    cfg.warmup.sft_steps = args.warmup_steps
    cfg.grpo.steps = args.steps
    cfg.eval.num_episodes = 0
    results: dict[str, Any] = {}
    for side in ("local", "ray"):
        side_cfg = cfg.model_copy(deep=True)
        side_cfg.run_dir = str(tmp / f"ray-pair-{side}")
        if side == "ray":
            side_cfg.launcher = "ray"
            if args.rollout_workers:
                side_cfg.ray.num_rollout_workers = args.rollout_workers
                side_cfg.ray.engine_cpus = 0.5
                side_cfg.ray.rollout_worker_cpus = 0.5 / args.rollout_workers
            run_on_ray(side_cfg, "blackjack")
        else:
            run(side_cfg, task)
        rows = [json.loads(line) for line in (tmp / f"ray-pair-{side}" / "metrics.jsonl").open()]
        steps = [r for r in rows if r.get("phase") == "train"][2:]
        wall_s = sum(r["step_s"] for r in steps)
        results[side] = {
            "completions_per_s": round(
                len(steps) * cfg.grpo.prompts_per_step * cfg.grpo.group_size / wall_s, 2
            ),
            "step_s_median": round(statistics.median(r["step_s"] for r in steps), 4),
            "trainer_wait_s_median": round(statistics.median(r["trainer_wait_s"] for r in steps), 4),
            "weight_publish_s_median": round(statistics.median(r["weight_publish_s"] for r in steps), 4),
        }
    ratio = round(results["ray"]["completions_per_s"] / results["local"]["completions_per_s"], 3)
    return {"ratio": ratio, **results}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="inflight bench pipeline", description=__doc__)
    parser.add_argument("--steps", type=at_least(1), default=30, help="training steps per side")
    parser.add_argument(
        "--warmup-steps", type=at_least(0), default=100, help="BlackJack warm-up (shared by both sides)"
    )
    parser.add_argument(
        "--max-staleness", type=at_least(0), default=2, help="the async side's max_staleness_steps"
    )
    parser.add_argument(
        "--only",
        choices=["blackjack", "latency", "ray"],
        help="run one pair: blackjack or latency (both by default), or ray (launcher=ray against the local "
        "launcher on BlackJack; needs inflight[ray]; only when asked for)",
    )
    parser.add_argument(
        "--rollout-workers",
        type=at_least(0),
        default=0,
        help="with --only ray: the Ray side plays its groups in this many rollout worker actors "
        "(ray.num_rollout_workers; 0: on the run's actor)",
    )
    args = parser.parse_args(argv)
    if args.rollout_workers and args.only != "ray":
        parser.error("--rollout-workers goes with --only ray")
    if args.only == "ray" and args.steps < 3:
        parser.error("--only ray times the steps after the second: give --steps 3 or more")
    result: dict[str, Any] = {
        "benchmark": "pipeline",
        "steps": args.steps,
        "max_staleness": args.max_staleness,
    }
    with tempfile.TemporaryDirectory(prefix="inflight-bench-pipeline-") as tmp:
        if args.only in (None, "latency"):
            lat = latency_task(args, Path(tmp))
            result["ratio_latency_task"] = lat.pop("ratio")
            result["latency_task"] = lat
        if args.only in (None, "blackjack"):
            bj = blackjack(args, Path(tmp))
            result["ratio_blackjack"] = bj.pop("ratio")
            result["blackjack"] = bj
        if args.only == "ray":
            pair = ray_pair(args, Path(tmp))
            result["ratio_ray_vs_local"] = pair.pop("ratio")
            result["rollout_workers"] = args.rollout_workers
            result["ray"] = pair
    print(json.dumps(result))
    return result
