"""`inflight bench trl`: inflight against TRL's GRPOTrainer on the same model, task, prompts, stops and loss.

Shape (issue 16 item 6): 8 prompts x 8 samples x up to 32 generated tokens per step, 30 steps, lr 1e-3.
- Model: the tiny preset (random weights, built locally), saved once as a Hugging Face directory in the
  run directory; every side loads that directory. `--seed N` seeds its weights (the tokenizer, and so the
  prompts' tokens, stay the preset's) and every side's run: inflight's `seed`, TRL's `GRPOConfig.seed`.
- Task (`benchmarks/trl_task.py`, imported by both sides): "Task k: write as many digits as you can.";
  reward = digits in the reply / 32, capped at 1, so random weights already earn a graded reward. Problem
  k of step s is k = 8 s + i on every side (TRL's dataset unshuffled, inflight's train problems in order).
- inflight, twice from the same weights: `mode=async` (the default pipeline, its default staleness bound;
  active sampling off so it trains exactly the prompts the others do) and `mode=sync`, each through
  `inflight.orchestrator.run.train`, the function `inflight run` trains with, and the trainer `inflight run`
  builds (`setup.build_loop_trainer`: the pipeline's in a process of its own on 2+ cores).
- TRL: `GRPOTrainer` (trl==1.16.0, torch==2.13.0 CPU, transformers pinned) in its own virtual environment,
  built once by `launch/venv_cache.py` and cached (`--trl-env`), in a subprocess (`benchmarks/trl_side.py`).

Loss on both sides: the clipped surrogate -min(r A, clip(r, 0.8, 1.2) A) averaged over every generated token
of the step (inflight `ppo` with `token_mean`; TRL `loss_type="dapo"`, epsilon 0.2), group advantages
(r - mean) / std, no KL and no entropy term, AdamW (0.9, 0.95, eps 1e-8, no weight decay), gradients clipped
at norm 1, constant lr. Throughput counts only the 30 training steps (loading and building excluded on every
side). "Reward at equal wall time" is each side's mean training reward over its last 5 steps finished by
the time the fastest side finished its 30 (every side has a reward curve up to then).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from benchmarks import at_least
from benchmarks.trl_task import prompt, reward
from inflight.launch.venv_cache import VenvBuildError, VenvLocationError, cached_venv, run_step

TRL_VERSION = "1.16.0"
# torch first and alone: pip takes the local CPU wheel and, with the constraint, never replaces it with a
# CUDA build while it resolves TRL. transformers is pinned to the version inflight is tested with, so both
# sides run the same model code.
TORCH_PIN = "torch==2.13.0"
TRANSFORMERS_PIN = "transformers==5.24.0"
INSTALL_TIMEOUT_S = 1800
REPO_ROOT = Path(__file__).resolve().parents[1]
REWARD_WINDOW_STEPS = 5
# A side's log, one entry per training step: {"step", "end_s" (seconds since training began), "reward" (the
# step's mean), "tokens" (generated in the step)}.
Steps = list[dict[str, float]]
RATE_KEYS = {"async": "completions_per_s", "sync": "completions_per_s_sync", "trl": "trl_completions_per_s"}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="inflight bench trl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=at_least(1), default=30, help="training steps per side")
    parser.add_argument("--prompts", type=at_least(1), default=8, help="prompts per step")
    parser.add_argument("--samples", type=at_least(2), default=8, help="samples per prompt (the group)")
    parser.add_argument(
        "--new-tokens", type=at_least(1), default=32, help="generated tokens per sample, at most"
    )
    parser.add_argument(
        "--lr", type=float, default=1e-3, help="learning rate, the same on every side (default %(default)s)"
    )
    parser.add_argument(
        "--seed",
        type=at_least(0),
        default=0,
        help="seeds the tiny model's random weights and every side's run (inflight's `seed`, TRL's "
        "GRPOConfig seed); repeat with other seeds to see the spread (default %(default)s)",
    )
    parser.add_argument("--sides", default="async,sync,trl", help="comma-separated subset of async,sync,trl")
    parser.add_argument("--run-dir", help="where the model, logs and result go (default runs/bench-trl-TIME)")
    parser.add_argument("--trl-version", default=TRL_VERSION, help="the trl release to pin")
    parser.add_argument(
        "--trl-env",
        help="TRL's virtual environment, built there if missing (default: cached in "
        "$INFLIGHT_CACHE/trl-envs, ~/.cache/inflight/trl-envs when unset)",
    )
    args = parser.parse_args(argv)
    sides = args.sides.split(",")
    if not sides or any(side not in ("async", "sync", "trl") for side in sides):
        parser.error(f"--sides takes a comma-separated subset of async,sync,trl, got {args.sides!r}")
    args.sides = sides
    return args


def reward_at(steps: Steps, t_s: float, window: int = REWARD_WINDOW_STEPS) -> float | None:
    """Mean reward of the last `window` steps that ended by `t_s` (seconds since training began); None when
    no step had ended by then."""
    done = [s["reward"] for s in steps if s["end_s"] <= t_s]
    return round(statistics.fmean(done[-window:]), 4) if done else None


def trl_env_dir(args: argparse.Namespace) -> Path:
    if args.trl_env:
        return Path(args.trl_env).expanduser().resolve()
    from inflight.orchestrator.setup import cache_dir

    name = f"trl-{args.trl_version}-{TORCH_PIN.split('==')[1]}-{TRANSFORMERS_PIN.split('==')[1]}"
    return cache_dir() / "trl-envs" / name


def trl_python(env: Path, version: str) -> Path:
    """The interpreter of TRL's environment at `env`, built first if missing; a UserError if it cannot be."""
    from inflight.errors import UserError

    try:
        return cached_venv(env, lambda directory: _build_trl_env(directory, version))
    except VenvLocationError as e:
        raise UserError(
            f"{env} cannot hold TRL's environment ({e}): name a new or empty directory you can write "
            "with --trl-env"
        ) from None
    except VenvBuildError as e:
        raise UserError(f"cannot install trl=={version} into {env}: {e}") from None


def _build_trl_env(env: Path, version: str) -> None:
    def step(what: str, *command: str) -> None:
        progress(f"trl env: {what}")
        run_step(what, *command, timeout_s=INSTALL_TIMEOUT_S)

    trl_pin = f"trl=={version}"
    # A release that does not exist fails here in a second, before a minute of installing torch.
    step(f"look up {trl_pin}", sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--no-deps",
         "--ignore-installed", trl_pin)  # fmt: skip
    step("create the venv", sys.executable, "-m", "venv", str(env))
    pip = (str(env / "bin" / "python"), "-m", "pip", "install", "-q")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
        constraints.write(f"{TORCH_PIN}\n")
    try:
        step(f"install {TORCH_PIN} (the local CPU wheel)", *pip, TORCH_PIN)
        step(
            f"install {trl_pin}, {TRANSFORMERS_PIN}", *pip, "-c", constraints.name, trl_pin, TRANSFORMERS_PIN
        )
        step("check that trl imports", str(env / "bin" / "python"), "-c", "from trl import GRPOTrainer")
    finally:
        os.unlink(constraints.name)


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class BenchTask:
    """trl_task's prompts and reward in inflight's rollout API (`load_problems` + `generate_rollout`)."""

    def load_problems(self, split: str) -> list[dict[str, Any]]:
        return [{"k": k} for k in range(10_000)]

    async def generate_rollout(self, ctx: Any, problem: dict[str, Any]) -> Any:
        chat = ctx.chat()
        chat.user(prompt(problem["k"]))
        reply = await chat.assistant()
        return chat.to_rollout(reward(reply))


def run_inflight(
    mode: Literal["async", "sync"], model_dir: Path, out: Path, args: argparse.Namespace, threads: int
) -> Steps:
    """One inflight run of args.steps steps from `model_dir`, by the loop `mode` names; its per-step log."""
    import torch

    from inflight.config import EvalConfig, GRPOConfig, ModelConfig, PipelineConfig, RunConfig, SamplingConfig
    from inflight.metrics.logger import METRICS_FILE, MetricsLogger
    from inflight.orchestrator.publish import policy_engine
    from inflight.orchestrator.run import train
    from inflight.orchestrator.setup import build_engine, build_loop_trainer, load_policy
    from inflight.orchestrator.sync_loop import LoopParts
    from inflight.orchestrator.task import Task, load_split
    from inflight.rollouts.chat import ChatFormat
    from inflight.trainer import LossConfig, TrainerConfig
    from inflight.trainer.process import TrainerProcess

    cfg = RunConfig(
        recipe="bench-trl",
        mode=mode,
        seed=args.seed,
        run_dir=str(out),
        progress=False,
        model=ModelConfig(path=str(model_dir)),
        trainer=TrainerConfig(
            lr=args.lr,
            micro_batch_size=args.prompts * args.samples,
            loss=LossConfig(name="ppo", reduction="token_mean"),
        ),
        sampling=SamplingConfig(temperature=1.0, max_tokens_per_turn=args.new_tokens),
        grpo=GRPOConfig(
            steps=args.steps,
            prompts_per_step=args.prompts,
            group_size=args.samples,
            advantage="mean_std",
            max_turns=1,
        ),
        # The same prompts as TRL: uninformative groups are trained on (as zeros), never replaced by new ones.
        pipeline=PipelineConfig(active_sampling=False),
        eval=EvalConfig(num_episodes=0),
    )
    # torch's default, as `inflight run` has it (and TRL's process has): an earlier side may have changed it.
    torch.set_num_threads(threads)
    bench = BenchTask()
    task = Task("bench-trl", bench.load_problems, bench.generate_rollout)
    model, tokenizer = load_policy(cfg)
    chat = ChatFormat.for_model(tokenizer, model)
    engine = build_engine(cfg, model, tokenizer)
    # As `inflight run` builds it: the pipeline's trainer in a process of its own on a CPU with 2+ cores
    # (pipeline.trainer_process=auto), the sync loop's in this process.
    trainer = build_loop_trainer(cfg, model, tokenizer)
    parts = LoopParts(policy_engine(engine, trainer), trainer, chat, task, load_split(task, "train"))
    try:
        logger = MetricsLogger(out)  # its time_s counts from here: the start of training
        train(parts, cfg, logger, out)
        logger.close()
    finally:
        if isinstance(trainer, TrainerProcess):
            trainer.close()
    rows = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]
    return [
        {"step": r["step"], "end_s": r["time_s"], "reward": r["reward_mean"], "tokens": r["generated_tokens"]}
        for r in rows
        if r["phase"] == "train"
    ]


def inflight_format(model_dir: Path) -> tuple[list[int], list[int]]:
    """The token ids of inflight's first prompt and the ids its replies stop at."""
    from inflight.models import load_model, load_tokenizer
    from inflight.rollouts.chat import ChatFormat

    chat = ChatFormat.for_model(load_tokenizer(model_dir), load_model(model_dir))
    return chat.first_turn(prompt(0)), list(chat.stop_token_ids)


def run_trl(python: Path, model_dir: Path, out: Path, args: argparse.Namespace) -> tuple[Steps, dict]:
    """TRL's run in its own environment: its per-step log, and what it reports of itself (versions, stops)."""
    out.mkdir(parents=True, exist_ok=True)
    command = [
        str(python), "-m", "benchmarks.trl_side",
        "--model", str(model_dir), "--out", str(out),
        "--steps", str(args.steps), "--prompts", str(args.prompts), "--samples", str(args.samples),
        "--new-tokens", str(args.new_tokens), "--lr", str(args.lr), "--seed", str(args.seed),
    ]  # fmt: skip
    # Run from the repository root so that `import trl` finds TRL and not benchmarks/trl.py.
    # Its output (TRL's own log lines among it) goes to stderr: stdout ends with this benchmark's JSON line.
    # No PYTHONPATH: nothing of this environment's packages may shadow TRL's.
    done = subprocess.run(command, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": ""}, stdout=sys.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"TRL's side failed with exit code {done.returncode} (its output is above)")
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    return steps, json.loads((out / "meta.json").read_text())


def side_summary(steps: Steps, completions_per_step: int) -> dict[str, Any]:
    wall_s = steps[-1]["end_s"]
    first, last = steps[:REWARD_WINDOW_STEPS], steps[-REWARD_WINDOW_STEPS:]
    return {
        "completions_per_s": round(len(steps) * completions_per_step / wall_s, 2),
        "wall_s": round(wall_s, 1),
        "steps": len(steps),
        "mean_completion_tokens": round(
            sum(s["tokens"] for s in steps) / (len(steps) * completions_per_step), 2
        ),
        "reward_first5": round(statistics.fmean(s["reward"] for s in first), 4),
        "reward_last5": round(statistics.fmean(s["reward"] for s in last), 4),
    }


def compare(sides: dict[str, Steps], completions_per_step: int) -> dict[str, Any]:
    """The headline keys: completions/s of each side, inflight's over TRL's, and reward at equal wall time
    (the time the fastest side took for all its steps)."""
    summaries = {name: side_summary(steps, completions_per_step) for name, steps in sides.items()}
    rate = {name: summary["completions_per_s"] for name, summary in summaries.items()}
    out: dict[str, Any] = {RATE_KEYS[name]: value for name, value in rate.items()}
    if "trl" in rate:
        if "async" in rate:
            out["ratio_vs_trl"] = round(rate["async"] / rate["trl"], 3)
        if "sync" in rate:
            out["ratio_sync_vs_trl"] = round(rate["sync"] / rate["trl"], 3)
    t_equal = min(summary["wall_s"] for summary in summaries.values())
    out["equal_wall_s"] = t_equal
    out["reward_at_equal_wall_s"] = {name: reward_at(steps, t_equal) for name, steps in sides.items()}
    out["sides"] = summaries
    return out


def fairness(args: argparse.Namespace, model_dir: Path, trl_meta: dict[str, Any]) -> dict[str, Any]:
    """What both sides share, stated; the prompt ids and stop ids as each side reports them."""
    prompt_ids, stop_ids = inflight_format(model_dir)
    return {
        "model": f"tiny preset, random weights, one Hugging Face directory both load: {model_dir}",
        "task": "benchmarks/trl_task.py, imported by both sides: reward = min(1, digits in the reply / 32)",
        "prompts": f"problem k = {args.prompts} * step + i, k < {args.steps * args.prompts}, on every side",
        "prompt_token_ids_identical": trl_meta.get("prompt_ids_0") == prompt_ids if trl_meta else None,
        "stop_token_ids": {"inflight": stop_ids, "trl": trl_meta.get("eos_token_ids")},
        "shape": f"{args.prompts} prompts x {args.samples} samples x {args.new_tokens} tokens",
        "steps": args.steps,
        "seed": args.seed,
        "sampling": "temperature 1, no top-p, no top-k",
        "loss": "-min(r A, clip(r, 0.8, 1.2) A), mean over the step's generated tokens: inflight "
        "loss.name=ppo, loss.reduction=token_mean; TRL loss_type=dapo, epsilon=0.2, beta=0",
        "advantages": "(r - mean) / std within each group (inflight leaves all-equal groups out of the step, "
        "TRL trains them with zero advantage)",
        "lr": args.lr,
        "optimizer": "AdamW (0.9, 0.95), eps 1e-8, no weight decay, grad norm clipped at 1, constant lr",
        "threads": "torch's default on the sync loop and TRL; the async pipeline one per stage (its default)",
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    run_dir = Path(args.run_dir or f"runs/bench-trl-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if run_dir.exists() and any(run_dir.iterdir()):
        from inflight.errors import UserError

        # A run directory with a checkpoint in it would make inflight's loops resume instead of train.
        raise UserError(f"--run-dir {run_dir} is not empty: give a new directory")
    # First: where TRL cannot be installed, say so before minutes of inflight runs.
    trl_env = trl_env_dir(args)
    python = trl_python(trl_env, args.trl_version) if "trl" in args.sides else None
    import torch

    from inflight.models import build_tiny

    threads = torch.get_num_threads()  # torch's default here, before any side changes it
    model_dir = build_tiny(run_dir / "model", preset="tiny", seed=args.seed)
    per_step = args.prompts * args.samples
    sides: dict[str, Steps] = {}
    modes: tuple[Literal["async", "sync"], ...] = ("async", "sync")
    for mode in modes:
        if mode in args.sides:
            progress(f"inflight mode={mode}: {args.steps} steps")
            sides[mode] = run_inflight(mode, model_dir, run_dir / f"inflight-{mode}", args, threads)
            progress(f"inflight mode={mode}: {side_summary(sides[mode], per_step)}")
    trl_meta: dict[str, Any] = {}
    if python is not None:
        progress(f"trl: {args.steps} steps, environment {trl_env}")
        sides["trl"], trl_meta = run_trl(python, model_dir, run_dir / "trl", args)
        progress(f"trl: {side_summary(sides['trl'], per_step)}")

    result: dict[str, Any] = {"benchmark": "trl", **compare(sides, per_step)}
    result["fairness"] = fairness(args, model_dir, trl_meta)
    if trl_meta:
        versions = {key: trl_meta[key] for key in ("trl_version", "torch", "transformers", "threads")}
        result["trl"] = {**versions, "env": str(trl_env)}
    result["run_dir"] = str(run_dir)
    (run_dir / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return result
