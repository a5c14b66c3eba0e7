"""Build what a run needs from its RunConfig: model directory, tokenizer, trainer, engine, run directory."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import torch

from inflight.config import RunConfig
from inflight.errors import UserError
from inflight.models.device import resolve_device
from inflight.preflight import ensure_dir
from inflight.trainer import Trainer, TrainerConfig
from inflight.trainer.process import StepTrainer, TrainerProcess, shared_memory_shortfall

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    return Path(os.environ.get("INFLIGHT_CACHE", Path.home() / ".cache" / "inflight"))


def resolve_model(cfg: RunConfig) -> str:
    """The model's directory or hub id; builds (once, cached) the tiny model when no path is given, its
    "Writing model shards" bar shown as the run's progress is (`hf_progress_bars`)."""
    if cfg.model.path:
        return cfg.model.path
    from inflight.models import build_tiny
    from inflight.models.loader import hf_progress_bars

    target = cache_dir() / "models" / f"tiny-{cfg.model.tiny_preset}-seed{cfg.model.tiny_seed}"
    if not (target / "config.json").is_file():
        # Build beside the target and rename: concurrent runs never see a half-written model.
        tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        with hf_progress_bars(cfg.progress):
            build_tiny(tmp, preset=cfg.model.tiny_preset, seed=cfg.model.tiny_seed)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race; its copy is byte-identical
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def run_dir_path(cfg: RunConfig) -> Path:
    """Where the run's directory is: cfg.run_dir, else runs/RECIPE-TIME (now)."""
    return Path(cfg.run_dir or f"runs/{cfg.recipe}-{time.strftime('%Y%m%d-%H%M%S')}").expanduser()


def make_run_dir(cfg: RunConfig, path: str | Path | None = None) -> Path:
    """`path` (default: `run_dir_path(cfg)`) as a writable directory, created if missing; nothing is written
    into it (`run` records config.json once a resume's checks passed)."""
    return ensure_dir(path or run_dir_path(cfg), "--run-dir")


def load_policy(cfg: RunConfig) -> tuple[torch.nn.Module, object]:
    from inflight.models import load_model, load_tokenizer

    name = resolve_model(cfg)
    torch.manual_seed(cfg.seed)
    return load_model(name, progress=cfg.progress), load_tokenizer(name)


def pad_id(tokenizer: object) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else 0


def build_trainer(
    model: torch.nn.Module, tokenizer: object, config: TrainerConfig, run_steps: int | None = None
) -> Trainer:
    """`run_steps`: the run's optimizer steps, the span of a decaying lr left at lr_decay_steps=0."""
    return Trainer(model, run_trainer_config(config, run_steps), pad_id=pad_id(tokenizer))


def run_trainer_config(config: TrainerConfig, run_steps: int | None) -> TrainerConfig:
    """`config` with a decaying lr's span (lr_decay_steps=0) set to the run's steps."""
    if config.lr_schedule != "constant" and not config.lr_decay_steps and run_steps is not None:
        # A run of 0 steps (evaluation only) never reads the schedule, but it must still be valid.
        config = config.model_copy(update={"lr_decay_steps": max(run_steps, 1)})
    return config


def build_loop_trainer(cfg: RunConfig, model: torch.nn.Module, tokenizer: object) -> StepTrainer:
    """The trainer the run's loop drives: `build_trainer`'s, in this process or (the pipeline's
    `pipeline.trainer_process`) in a process of its own. Close a TrainerProcess when the run ends."""
    if not wants_trainer_process(cfg):
        return build_trainer(model, tokenizer, cfg.trainer, cfg.grpo.steps)
    shortfall = shared_memory_shortfall(model)
    if shortfall is not None:
        if cfg.pipeline.trainer_process is True:
            raise UserError(
                f"pipeline.trainer_process=true: {shortfall}; or set pipeline.trainer_process=false"
            )
        log.warning("the pipeline's trainer runs in a thread of this process (slower): %s", shortfall)
        return build_trainer(model, tokenizer, cfg.trainer, cfg.grpo.steps)
    config = run_trainer_config(cfg.trainer, cfg.grpo.steps)
    cpus = pinned_trainer_cpus(cfg, frozenset(os.sched_getaffinity(0)))
    return TrainerProcess(model, config, pad_id(tokenizer), threads=cfg.pipeline.torch_threads, cpus=cpus)


def pinned_trainer_cpus(cfg: RunConfig, available: frozenset[int]) -> frozenset[int] | None:
    """The CPUs `pipeline.pin_cpus` pins the pipeline's trainer process to: the last torch_threads of
    `available` (this process's CPUs), the others left to the engine's side; None: not pinned.

    Pinning pays where the two stages would otherwise share the CPUs: the engine's side runs more than one
    thread (the engine's torch ops release the GIL to the rollouts' event loop), and without pinning those
    threads also run on the trainer's core. On 2 cores, BlackJack's pipeline (`inflight bench pipeline`)
    ran ~6% faster pinned, its trainer's step ~15% (docs/benchmarks.md)."""
    choice, threads = cfg.pipeline.pin_cpus, cfg.pipeline.torch_threads
    enough = len(available) >= 2 * threads
    if choice is True and not enough:
        log.warning(
            "pipeline.pin_cpus=true: %d CPUs cannot give the engine and the trainer %d each; not pinned",
            len(available),
            threads,
        )
    if not choice or not enough or (choice == "auto" and len(available) != 2 * threads):
        return None
    return frozenset(sorted(available)[-threads:])


def wants_trainer_process(cfg: RunConfig) -> bool:
    """Whether the pipeline's trainer gets a process of its own (`pipeline.trainer_process`)."""
    choice = cfg.pipeline.trainer_process
    if choice != "auto":
        return bool(choice) and cfg.mode == "async"
    on_cpu = all(
        resolve_device(device, key).type == "cpu"
        for device, key in ((cfg.trainer.device, "trainer.device"), (cfg.engine.device, "engine.device"))
    )
    # Also with the engines elsewhere (pipeline.engine_urls, launcher=ray): the rollouts' event loop, their
    # HTTP and JSON, still share this process's GIL, and a trainer thread beside it stepped ~1.7x slower
    # (BlackJack under Ray, docs/benchmarks.md).
    return cfg.mode == "async" and on_cpu and (os.cpu_count() or 1) >= 2


def build_engine(cfg: RunConfig, model: torch.nn.Module, tokenizer: object):  # -> BuiltinEngine
    from inflight.inference.builtin import BuiltinEngine

    if cfg.engine.max_seq_len_tokens < 8:
        raise UserError("engine.max_seq_len_tokens is too small to hold a prompt")
    # The engine copies the weights it is built with: trainer updates reach it only through update_weights.
    return BuiltinEngine(model, tokenizer=tokenizer, config=cfg.engine)
