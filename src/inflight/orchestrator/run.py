"""`run(cfg, task)`: one training run of any Task, in either mode, started fresh or resumed.

The phases, in order: check the task (its splits, its Env, its warm-up) before anything is written; the run
directory; the policy; the warm-up (if cfg.warmup.sft_steps); evaluation on the test split; cfg.grpo.steps
of GRPO (the sync loop or the pipeline, by cfg.mode; both continue a checkpoint found in the run
directory); evaluation again; checkpoint; summary. Owns the run directory's files (config.json,
metrics.jsonl, warmup/, checkpoint/, summary.json, curves.png) and the summary keys every task shares; a
run that fails before its first step leaves no run directory behind. A resume (`check_resume`) trains
neither the warm-up nor evaluates the initial policy again, and its summary covers the whole run, read
from metrics.jsonl. Knows nothing of any one task.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from inflight.config import RunConfig
from inflight.envs.base import Environment
from inflight.errors import UserError, describe
from inflight.gc_tuning import long_lived_frozen
from inflight.metrics.logger import METRICS_FILE, MetricsLogger, read_metrics
from inflight.metrics.plot import plot_run
from inflight.orchestrator.drivers import Driver, InlineDriver
from inflight.orchestrator.evaluate import evaluate
from inflight.orchestrator.publish import policy_engine, publish
from inflight.orchestrator.rollout_group import GroupPlayer
from inflight.orchestrator.setup import (
    build_engine,
    build_loop_trainer,
    load_policy,
    make_run_dir,
    pad_id,
    run_dir_path,
)
from inflight.orchestrator.stopping import StopRequest
from inflight.orchestrator.sync_loop import LoopParts
from inflight.orchestrator.sync_loop import train as train_sync
from inflight.orchestrator.task import HookError, Problems, Task, load_split
from inflight.orchestrator.task_warmup import task_warmup
from inflight.orchestrator.warmup import WARMUP_DIR, checked_reply, format_warmup, warmup_steps_done
from inflight.rollouts.chat import ChatFormat
from inflight.trainer.checkpoint import OtherModelError, check_resumable, checkpoint_step
from inflight.trainer.process import StepTrainer, TrainerProcess

if TYPE_CHECKING:
    import torch

EvalName = Literal["initial", "during", "final"]  # an evaluation's `eval` field in metrics.jsonl (`eval_row`)
# A launcher's engines, started once the run is accepted: given the run's config, a context that yields it
# as the run goes on with (pipeline.engine_urls naming them) and stops them on exit.
StartEngines = Callable[[RunConfig], contextlib.AbstractContextManager[RunConfig]]


def train(
    parts: LoopParts,
    cfg: RunConfig,
    logger: MetricsLogger,
    run_dir: str | Path,
    evaluate: Callable[[Driver], dict[str, Any]] | None = None,
    launcher_metrics: Callable[[], dict[str, float]] | None = None,
    players: GroupPlayer | None = None,
) -> list[dict[str, float]]:
    """cfg.grpo.steps of GRPO by the sync loop or the pipeline (cfg.mode); returns this call's metrics.
    `players` (the pipeline's only): rollout workers elsewhere that play its groups."""
    if cfg.mode == "sync":
        if players is not None:
            raise UserError("rollout workers of their own (ray.num_rollout_workers) need mode=async")
        return train_sync(parts, cfg, logger, str(run_dir), evaluate)
    from inflight.orchestrator.pipeline import run_pipeline

    return run_pipeline(parts, cfg, logger, run_dir, evaluate, launcher_metrics, players)


def run(
    cfg: RunConfig,
    task: Task,
    launcher_metrics: Callable[[], dict[str, float]] | None = None,
    make_trainer: Callable[[RunConfig, torch.nn.Module, object], StepTrainer] | None = None,
    players: GroupPlayer | None = None,
    stop: StopRequest | None = None,
    engines: StartEngines | None = None,
) -> dict[str, Any]:
    """Train `task` as `cfg` says; returns the summary (also in RUN_DIR/summary.json).

    This is the whole run in this process; `launch/ray/run.py` calls it inside the trainer's actor, with
    `pipeline.engine_urls` naming the replicas it placed, `launcher_metrics` counting their restarts
    (logged with every pipeline step) and `make_trainer` building the trainer over the warmed-up model
    (there: data-parallel ranks in actors of their own; by default `build_loop_trainer`) and `players`
    playing the pipeline's groups (there: rollout workers in actors of their own; by default the
    pipeline's event loop). `engines` starts a launcher's engines (`launch/local.py`'s vLLM process) once
    the run is accepted, since they write into the run directory. `stop`, once set (a signal:
    `stopping.py`), ends the warm-up or the training after the step in flight; a stopped training then
    checkpoints, evaluates and summarizes as usual, a stopped warm-up saves its state (RUN_DIR/warmup) and
    summarizes, `stopped` naming the signal. Set during the initial evaluation, it lets the evaluation
    finish (logged) and trains no step.

    A run directory with a checkpoint is resumed: the warm-up is loaded from RUN_DIR/warmup rather than
    trained again, and the initial evaluation is the one metrics.jsonl holds (the checkpoint's weights are
    no longer the initial policy; a run stopped before its first step logged it too). A run directory of
    another task, a checkpoint past cfg.grpo.steps, or a checkpoint or saved warm-up that the model cannot
    continue (another model's, a full model under trainer.lora_rank > 0 and the reverse, or an adapter of
    another rank) is refused before anything is written into it, and before `engines` start."""
    t0 = time.perf_counter()
    train_problems = load_split(task, "train")
    test_problems = load_split(task, "test") if cfg.eval.num_episodes else []
    check_task(cfg, task)
    path = run_dir_path(cfg)  # once: without cfg.run_dir it names the current second
    # Before any weights load and before anything is written into the run directory: a damaged checkpoint,
    # another task's run directory or a finished run shows now, in one line.
    first_step = check_resume(cfg, path)
    if first_step == cfg.grpo.steps and (finished := _finished_summary(path, first_step)) is not None:
        _note(
            f"{path} is already trained to grpo.steps={first_step} (its checkpoint is at step {first_step}): "
            "nothing to do; set grpo.steps higher to train further"
        )
        return finished
    with _run_directory(cfg, path) as run_dir:
        model, tokenizer = load_policy(cfg)
        # What only the model can tell, still before anything is written: a refused resume leaves the run
        # directory as it was.
        _check_resumable(cfg, run_dir, model)
        if first_step:
            _note(f"resuming from the checkpoint at step {first_step} ({path / 'checkpoint'})")
        # Closed however the run ends: a W&B run is finished, TensorBoard flushed, the engines stopped.
        with contextlib.ExitStack() as stack:
            if engines is not None:  # accepted: only now may they write (RUN_DIR/weights)
                cfg = stack.enter_context(engines(cfg))
            (run_dir / "config.json").write_text(json.dumps(cfg.model_dump(), indent=2))
            logger = stack.enter_context(
                contextlib.closing(MetricsLogger(run_dir, cfg.metrics, cfg.model_dump()))
            )

            def stopped_before_training(reason: str, initial: dict[str, float]) -> dict[str, Any]:
                """A signal came before this command's first step: no step trained, so no checkpoint to
                write; the summary says so, and the same command goes on from here."""
                summary = build_summary(
                    cfg, task, run_dir, t0, first_step, [], len(test_problems), initial, {}, reason
                )
                logger.log(first_step, summary, phase="summary")
                return _finish(run_dir, summary)

            # The imports and the model, most of the heap: the collector leaves them alone until the end.
            stack.enter_context(long_lived_frozen())
            chat = ChatFormat.for_model(tokenizer, model)
            _warm_up(cfg, task, model, tokenizer, chat, train_problems, run_dir, first_step, logger, stop)
            if stop is not None and stop.reason is not None:
                # During the loading or the warm-up (saved: `_warm_up`): nothing evaluated either.
                return stopped_before_training(stop.reason, _logged_initial(run_dir))
            # The engine first: it copies the weights, and a LoRA trainer then wraps the model's layers.
            engine = build_engine(cfg, model, tokenizer)
            # The pipeline's may be a process of its own; a launcher's, ranks elsewhere.
            trainer = (make_trainer or build_loop_trainer)(cfg, model, tokenizer)
            if isinstance(trainer, TrainerProcess):
                stack.callback(trainer.close)
            parts = LoopParts(policy_engine(engine, trainer), trainer, chat, task, train_problems, stop)

            def test(driver: Driver, num_problems: int, title: str | None = None) -> dict[str, float]:
                return evaluate(task, test_problems, cfg, chat, driver, num_problems, title)

            # How many test problems each evaluation plays: the final one, the initial one, and those during.
            evaluated = min(cfg.eval.num_episodes, len(test_problems))
            evaluated_initial = initial_episodes(cfg, len(test_problems))
            evaluated_during = min(cfg.eval.num_episodes_during, len(test_problems))

            def during(driver: Driver) -> dict[str, Any]:  # no progress of its own: the training's shows
                return eval_row("during", evaluated_during, test(driver, cfg.eval.num_episodes_during))

            # The initial evaluation once per run: an earlier command's, when one logged it (a resume, whose
            # policy before training is gone; a run stopped before its first step), else made now.
            initial = _logged_initial(run_dir)
            if not initial and not first_step:
                initial = test(InlineDriver(parts.engine), evaluated_initial, "initial evaluation")
                if initial:
                    logger.log(0, eval_row("initial", evaluated_initial, initial), phase="eval")
            if stop is not None and stop.reason is not None and first_step < cfg.grpo.steps:
                # During the initial evaluation (which finishes: it is the run's only one of its policy) or
                # the engine's and trainer's start. Here, not in the loops: they look only after a step.
                kept = f"; the initial evaluation is kept in {run_dir / METRICS_FILE}" if initial else ""
                _note(
                    f"stopped before training step {first_step}, none trained{kept}; the same command trains "
                    "from there"
                )
                return stopped_before_training(stop.reason, initial)
            evaluate_during = during if test_problems else None
            history = train(parts, cfg, logger, run_dir, evaluate_during, launcher_metrics, players)
            last_step = first_step + len(history)
            # Before the final evaluation, so that a second Ctrl-C during it keeps this step for a resume.
            if cfg.mode == "sync":  # the pipeline writes its own (with stream offsets and buffered groups)
                trainer.save_checkpoint(run_dir / "checkpoint", extra={"step": last_step})
            # The trained weights, whichever engine (or inference replica) generated with them.
            publish(parts.engine, trainer)
            final = test(InlineDriver(parts.engine), cfg.eval.num_episodes, "final evaluation")
            if final:
                logger.log(last_step, eval_row("final", evaluated, final), phase="eval")

            # A signal that came after the last step (during the final evaluation) stopped nothing.
            stopped = stop.reason if stop is not None and last_step < cfg.grpo.steps else None
            summary = build_summary(
                cfg, task, run_dir, t0, first_step, history, len(test_problems), initial, final, stopped
            )
            logger.log(last_step, summary, phase="summary")
        _finish(run_dir, summary)
    # Out of the run directory's block: a run of no step that fails here keeps what it wrote.
    _check_summarized(summary, run_dir)
    _note_skipped_steps(cfg, summary)
    return summary


def _finish(run_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_run(run_dir)
    return summary


def _check_summarized(summary: dict[str, Any], run_dir: Path) -> None:
    """UserError once the run's own summary and curves are written, when the task's `summarize` failed: the
    summary lacks its keys (`summarize_error` says why), and the same command, once it is fixed, evaluates
    the final policy again and adds them (`_finished_summary`)."""
    error = summary.get("summarize_error")
    if error is not None:
        raise UserError(
            f"{error}; the run's own summary is in {run_dir / 'summary.json'}, without the task's keys: fix "
            "summarize and run the same command again to add them"
        )


def _note_skipped_steps(cfg: RunConfig, summary: dict[str, Any]) -> None:
    """One line when most of the run's steps updated nothing: a run that learns nothing looks like one
    that trains, but for the skipped count in metrics.jsonl."""
    steps, skipped = summary["steps"], summary["steps_skipped"]
    if not steps or 2 * skipped <= steps:
        return
    sft_steps = cfg.warmup.sft_steps
    never = (
        f"the model cannot produce the format yet after the warm-up (warmup.sft_steps={sft_steps})"
        if sft_steps
        else "the model never produces the format (no warm-up: warmup.sft_steps=0)"
    )
    _note(
        f"{skipped} of the run's {steps} steps updated nothing (steps_skipped): in every group every rollout "
        "got the same reward, which teaches nothing. Usually the replies are too short for the answer "
        f"format (sampling.max_tokens_per_turn={cfg.sampling.max_tokens_per_turn}), {never}, or the reward "
        "is the same whatever the reply"
    )


def _note(line: str) -> None:
    """One line on stderr, beside the progress bar and the signal's line (`stopping.py`)."""
    print(f"inflight: {line}", file=sys.stderr, flush=True)


def _warm_up(
    cfg: RunConfig,
    task: Task,
    model: torch.nn.Module,
    tokenizer: object,
    chat: ChatFormat,
    train_problems: Problems,
    run_dir: Path,
    first_step: int,
    logger: MetricsLogger,
    stop: StopRequest | None,
) -> None:
    """The warm-up (cfg.warmup.sft_steps), trained, continued or loaded from RUN_DIR/warmup (`warmup.py`).
    A signal stops it after its step in flight, its state saved (the same command continues it).

    A resumed run (`first_step` > 0) loads it: its weights are the base a LoRA adapter was trained on and
    the KL reference. A run directory from before RUN_DIR/warmup existed has none to load; the warm-up,
    deterministic, is then trained again, unlogged (metrics.jsonl holds it once already)."""
    state_dir = run_dir / WARMUP_DIR
    saved = warmup_steps_done(state_dir)
    if not cfg.warmup.sft_steps and saved is None:
        return
    if saved is not None and saved[0] < min(saved[1], cfg.warmup.sft_steps):
        # Of this command's warmup.sft_steps, which it continues to, not of those the stopped one asked.
        _note(f"continuing the warm-up after its step {saved[0]} of {cfg.warmup.sft_steps} ({state_dir})")
    warm_logger = logger if first_step == 0 else None
    if task.env is not None:

        def new_env() -> Environment:
            return task.make_env(cfg, "train")

        reply = checked_reply(task.warmup_reply, task.name) if task.warmup_reply else None
        format_warmup(
            model, pad_id(tokenizer), chat, new_env, cfg, warm_logger, reply, state_dir=state_dir, stop=stop,
        )  # fmt: skip
    else:
        task_warmup(
            model, pad_id(tokenizer), task, train_problems, chat, cfg, warm_logger,
            state_dir=state_dir, stop=stop,
        )  # fmt: skip
    done, asked = warmup_steps_done(state_dir) or (0, cfg.warmup.sft_steps)
    if done < min(asked, cfg.warmup.sft_steps):
        _note(
            f"the warm-up stopped after its step {done} of {asked}, saved in {state_dir}: the same command "
            "continues it"
        )


def check_resume(cfg: RunConfig, path: Path) -> int:
    """The step a run in `path` starts at (that of its checkpoint; 0 without one), or UserError when `path`
    holds another task's run, or a checkpoint already past cfg.grpo.steps.

    Past grpo.steps is an error, not a finished run: the command asks for fewer steps than were trained,
    and carrying on would report the checkpoint's steps as this command's (exit 2 says so to a script);
    a checkpoint exactly at grpo.steps is the same command run again (a requeued job), answered with the
    summary it wrote (`run`)."""
    recorded = _recorded_config(path)
    if recorded is not None and recorded.get("recipe") not in (None, cfg.recipe):
        raise UserError(
            f"{path} holds a run of the task {recorded['recipe']!r}, not {cfg.recipe!r}: give this run "
            f"another --run-dir, or move {path} away"
        )
    step = checkpoint_step(path / "checkpoint")
    if step > cfg.grpo.steps:
        raise UserError(
            f"the checkpoint in {path} is at step {step}, past grpo.steps={cfg.grpo.steps}: set grpo.steps "
            f"above {step} to train further, or give this run another --run-dir to start over"
        )
    return step


def _check_resumable(cfg: RunConfig, run_dir: Path, model: torch.nn.Module) -> None:
    """`check_resumable` on the checkpoint and the saved warm-up (whose weights are the whole model's,
    whatever trainer.lora_rank). A checkpoint of another tiny model names model.tiny_preset, the key this
    command changed from the run's config.json, where `check_resumable` can only say model.path."""
    try:
        check_resumable(run_dir / "checkpoint", model, cfg.trainer.lora_rank)
        check_resumable(run_dir / WARMUP_DIR, model, lora_rank=0)
    except OtherModelError:
        was = _tiny_preset(_recorded_config(run_dir))
        if cfg.model.path or was in (None, cfg.model.tiny_preset):
            raise
        key, now = "model.tiny_preset", cfg.model.tiny_preset
        raise UserError(
            f"{run_dir} holds a run of {key}={was} (its config.json), and this command has {key}={now}: its "
            f"weights do not fit this model; resume with {key}={was}, or give this run another --run-dir"
        ) from None


def _tiny_preset(recorded: dict[str, Any] | None) -> str | None:
    """The tiny model's preset a recorded run trained (None: it trained a model.path, or none is known)."""
    model = (recorded or {}).get("model")
    if not isinstance(model, dict) or model.get("path"):
        return None
    preset = model.get("tiny_preset")
    return preset if isinstance(preset, str) else None


def _recorded_config(path: Path) -> dict[str, Any] | None:
    """The config.json a run wrote into `path` at its start, if there is one (another file of that name,
    a model's say, is no run's)."""
    try:
        recorded = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return recorded if isinstance(recorded, dict) and "grpo" in recorded else None


def _finished_summary(path: Path, steps: int) -> dict[str, Any] | None:
    """The summary a run in `path` wrote on finishing `steps` steps; None when it did not (killed during its
    final evaluation, or stopped: the run still has to finish; or its task's `summarize` failed: the run
    still has to add its keys)."""
    try:
        summary = json.loads((path / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or "summarize_error" in summary:
        return None
    return summary if summary.get("steps") == steps and summary.get("stopped") is None else None


def _logged_initial(run_dir: Path) -> dict[str, float]:
    """The initial evaluation (step 0's `eval` row, `test/` stripped) as the run's first process logged it;
    {} when it logged none. A row without `eval` (a run from before it was logged) at step 0 is the initial
    one: only a run of grpo.steps=0 logs another there, the final one, after it."""
    for row in read_metrics(run_dir):
        if row.get("phase") == "eval" and row.get("step") == 0 and row.get("eval", "initial") == "initial":
            return {k.removeprefix("test/"): v for k, v in row.items() if k.startswith("test/")}
    return {}


def check_task(cfg: RunConfig, task: Task) -> None:
    """What can be wrong with a task under this config, found before the run directory exists."""
    if task.env is None:
        if cfg.env.name:
            raise UserError(
                f"env.name={cfg.env.name!r}: {task.name} is written with generate_rollout and plays no Env; "
                "unset env.name"
            )
        if cfg.warmup.sft_steps and task.warmup_reply is None:
            raise UserError(
                f"warmup.sft_steps={cfg.warmup.sft_steps} needs a `warmup_reply(transcript, rng) -> str` in "
                f"{task.name} (the scripted replies of its warm-up); or set warmup.sft_steps=0"
            )
        return
    # One environment, built and closed: a factory's bad arguments or return value show here, in one line.
    try:
        env = task.make_env(cfg, "train")
    except UserError:
        raise
    except Exception as e:
        raise UserError(
            f"{task.name}: building its environment with env.kwargs={cfg.env.kwargs} failed: {describe(e)}"
        ) from None
    if not (callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
        raise UserError(
            f"{task.name}: its Env factory returned a {type(env).__name__}, not an environment with "
            "reset() and step() (an inflight.envs.Environment)"
        )
    env.close()


@contextmanager
def _run_directory(cfg: RunConfig, path: Path) -> Iterator[Path]:
    """The run directory `path`, created here; removed again if this run made it and fails before its first
    step (a resumed run's directory is never removed)."""
    fresh = not path.exists() or (path.is_dir() and not any(path.iterdir()))
    run_dir = make_run_dir(cfg, path)
    try:
        yield run_dir
    except BaseException:
        if fresh and not _trained_a_step(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def _trained_a_step(run_dir: Path) -> bool:
    try:
        return '"phase": "train"' in (run_dir / METRICS_FILE).read_text()  # the logger's json.dumps
    except OSError:
        return False


def initial_episodes(cfg: RunConfig, test_problems: int) -> int:
    """How many test problems the initial evaluation plays greedily: eval.num_episodes_initial of the
    final evaluation's (all of them when None), at most the split's."""
    share = cfg.eval.num_episodes_initial
    evaluated = min(cfg.eval.num_episodes, test_problems)
    return evaluated if share is None else min(share, evaluated)


def eval_row(which: EvalName, episodes: int, metrics: dict[str, float]) -> dict[str, Any]:
    """An evaluation's metrics.jsonl row (phase=eval): `eval` names which one (`initial` before training
    over eval.num_episodes_initial, `during` every eval.every_steps over eval.num_episodes_during, `final`
    after it over eval.num_episodes)
    and `episodes` how many test problems it played greedily (the sampled pass plays the first
    eval.num_episodes_sampled of them); its metrics under `test/`. At the last step a `during` and the
    `final` row are both logged, over different numbers of episodes: only these fields tell them apart."""
    return {"eval": which, "episodes": episodes, **{f"test/{key}": value for key, value in metrics.items()}}


def build_summary(
    cfg: RunConfig,
    task: Task,
    run_dir: Path,
    t0: float,
    first_step: int,
    history: list[dict[str, float]],
    test_problems: int,
    initial: dict[str, float],
    final: dict[str, float],
    stopped: str | None = None,
) -> dict[str, Any]:
    """The keys every task reports, in this order: recipe, mode, steps (the whole run's, those before a
    resume included), steps_skipped (those of them that updated nothing: no group's rewards differed),
    wall_s (this process's seconds, from the start of `run` to the summary), wall_s_total (the seconds of
    every process of the run that wrote a summary to metrics.jsonl, this one included: a process killed
    before its summary is missing from it), eval_problems and eval_problems_sampled (how many test problems
    the final evaluation played, greedy and sampled), eval_problems_initial (how many the initial one played
    greedily; its sampled pass the first eval_problems_sampled of them), eval_errors_initial/final(_sampled)
    (how many of those rollouts failed, left out of the returns), return_initial/final (greedy decoding on
    the test problems), return_initial/final_sampled (the sampling policy), the task's `summarize()` keys,
    return_first10/last10 (mean training reward of the first and last tenth of the whole run's steps, those
    before a resume read from metrics.jsonl), stopped (the signal that ended the training before
    cfg.grpo.steps, else None), run_dir; and summarize_error, only when the task's `summarize` failed (its
    keys are then left out)."""
    rows = read_metrics(run_dir) if (run_dir / METRICS_FILE).is_file() else []
    step_rows = _earlier_steps(rows, first_step) + history  # the whole run's, in order
    rewards = [_reward(row) for row in step_rows]
    wall_s = round(time.perf_counter() - t0, 1)
    earlier_wall_s = sum(
        r["wall_s"] for r in rows if r.get("phase") == "summary" and _is_number(r.get("wall_s"))
    )
    evaluated, sampled_cap = min(cfg.eval.num_episodes, test_problems), cfg.eval.num_episodes_sampled
    tenth = max(1, len(rewards) // 10)
    ours = {
        "recipe": cfg.recipe,
        "mode": cfg.mode,
        "steps": first_step + len(history),
        "steps_skipped": sum(bool(row.get("steps_skipped")) for row in step_rows),
        "wall_s": wall_s,
        "wall_s_total": round(earlier_wall_s + wall_s, 1),
        "eval_problems": evaluated,
        "eval_problems_sampled": evaluated if sampled_cap is None else min(sampled_cap, evaluated),
        "eval_problems_initial": initial_episodes(cfg, test_problems),
        "eval_errors_initial": _count(initial.get("rollout_errors_greedy")),
        "eval_errors_final": _count(final.get("rollout_errors_greedy")),
        "eval_errors_initial_sampled": _count(initial.get("rollout_errors")),
        "eval_errors_final_sampled": _count(final.get("rollout_errors")),
        "return_initial": _rounded(initial.get("return_greedy")),
        "return_final": _rounded(final.get("return_greedy")),
        "return_initial_sampled": _rounded(initial.get("return")),
        "return_final_sampled": _rounded(final.get("return")),
    }
    end = {
        "return_first10": round(statistics.fmean(rewards[:tenth]), 4) if rewards else None,
        "return_last10": round(statistics.fmean(rewards[-tenth:]), 4) if rewards else None,
        "stopped": stopped,
        "run_dir": str(run_dir),
    }
    try:
        extra = _task_keys(cfg, task, initial, final, ours.keys() | end.keys())
    except UserError as e:  # written without them, then reported (`_check_summarized`): nothing is lost
        return ours | end | {"summarize_error": str(e)}
    return ours | extra | end


def _task_keys(
    cfg: RunConfig, task: Task, initial: dict[str, float], final: dict[str, float], ours: Iterable[str]
) -> dict[str, Any]:
    """The task's `summarize` keys, once both evaluations exist; HookError when one is a key of ours.

    Refused rather than kept under a prefix: a task returning `return_final` means to replace it, and a
    rename would leave a script reading the summary with a value the task did not mean, or with nothing
    where it looked; the shared keys mean the same for every task."""
    if not (initial and final):
        return {}
    extra = task.summary_keys(cfg, initial, final)
    taken = sorted(set(extra) & {*ours, "summarize_error"})
    if taken:
        raise HookError(
            f"{task.name}: summarize(cfg, initial, final) returned keys the summary has already "
            f"({', '.join(taken)}): give them names of their own"
        )
    return extra


def _earlier_steps(rows: list[dict[str, Any]], first_step: int) -> list[dict[str, Any]]:
    """The training rows of steps 0 .. first_step - 1, as metrics.jsonl logged them. A step logged twice
    (after a kill, the run went back to its last checkpoint) counts once: the later row, the one the
    checkpoint continued from."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:
        step = row.get("step")
        if row.get("phase") == "train" and isinstance(step, int) and 0 <= step < first_step:
            by_step[step] = row
    return [by_step[step] for step in sorted(by_step)]


def _reward(row: dict[str, Any]) -> float:
    """A step's training reward; NaN where it has none (a step whose rollouts all failed)."""
    reward = row.get("reward_mean")
    return float(reward) if isinstance(reward, int | float) else math.nan


def _count(value: float | None) -> int | None:
    return int(value) if value is not None else None


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _rounded(value: float | None) -> float | None:
    return round(value, 4) if value is not None else None
