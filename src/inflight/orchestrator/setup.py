"""Build what a run needs from its RunConfig: model directory, tokenizer, trainer, engine, run directory."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch

from inflight.config import RunConfig
from inflight.errors import UserError
from inflight.preflight import ensure_dir
from inflight.trainer import Trainer, TrainerConfig


def cache_dir() -> Path:
    return Path(os.environ.get("INFLIGHT_CACHE", Path.home() / ".cache" / "inflight"))


def resolve_model(cfg: RunConfig) -> str:
    """The model's directory or hub id; builds (once, cached) the tiny model when no path is given."""
    if cfg.model.path:
        return cfg.model.path
    from inflight.models import build_tiny

    target = cache_dir() / "models" / f"tiny-{cfg.model.tiny_preset}-seed{cfg.model.tiny_seed}"
    if not (target / "config.json").is_file():
        # Build beside the target and rename: concurrent runs never see a half-written model.
        tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        build_tiny(tmp, preset=cfg.model.tiny_preset, seed=cfg.model.tiny_seed)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race; its copy is byte-identical
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def make_run_dir(cfg: RunConfig, path: str | Path | None = None) -> Path:
    """`path` (default: cfg.run_dir, else runs/RECIPE-TIME) as a writable directory holding config.json."""
    path = path or cfg.run_dir or f"runs/{cfg.recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = ensure_dir(path, "--run-dir")
    (run_dir / "config.json").write_text(json.dumps(cfg.model_dump(), indent=2))
    return run_dir


def load_policy(cfg: RunConfig) -> tuple[torch.nn.Module, object]:
    from inflight.models import load_model, load_tokenizer

    name = resolve_model(cfg)
    torch.manual_seed(cfg.seed)
    return load_model(name), load_tokenizer(name)


def pad_id(tokenizer: object) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else 0


def build_trainer(
    model: torch.nn.Module, tokenizer: object, config: TrainerConfig, run_steps: int | None = None
) -> Trainer:
    """`run_steps`: the run's optimizer steps, the span of a decaying lr left at lr_decay_steps=0."""
    if config.lr_schedule != "constant" and not config.lr_decay_steps and run_steps is not None:
        # A run of 0 steps (evaluation only) never reads the schedule, but it must still be valid.
        config = config.model_copy(update={"lr_decay_steps": max(run_steps, 1)})
    return Trainer(model, config, pad_id=pad_id(tokenizer))


def build_engine(cfg: RunConfig, model: torch.nn.Module, tokenizer: object):  # -> BuiltinEngine
    from inflight.inference.builtin import BuiltinEngine

    if cfg.engine.max_seq_len_tokens < 8:
        raise UserError("engine.max_seq_len_tokens is too small to hold a prompt")
    # The engine copies the weights it is built with: trainer updates reach it only through update_weights.
    return BuiltinEngine(model, tokenizer=tokenizer, config=cfg.engine)
