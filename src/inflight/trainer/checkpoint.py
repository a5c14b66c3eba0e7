"""Trainer checkpoints: model weights (safetensors), optimizer state and the step, written atomically.

A checkpoint is a directory; it is written under a temporary name and renamed into place, so a crash
mid-write never leaves a half checkpoint where a resume would find it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from inflight.errors import UserError
from inflight.trainer.trainer import Trainer

WEIGHTS = "model.safetensors"
OPTIMIZER = "optimizer.pt"
META = "trainer_state.json"


def save_checkpoint(trainer: Trainer, path: str | Path, extra: dict | None = None) -> Path:
    """Write weights + optimizer + version to `path` (replacing an older checkpoint there)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # safetensors refuses shared storage; contiguous clones keep tied weights writable too.
    state = {k: v.detach().contiguous().clone() for k, v in trainer.model.state_dict().items()}
    save_file(state, str(tmp / WEIGHTS))
    torch.save(trainer.optimizer.state_dict(), tmp / OPTIMIZER)
    (tmp / META).write_text(json.dumps({"version": trainer.version, **(extra or {})}, indent=2))
    if path.exists():
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)
    return path


def load_checkpoint(trainer: Trainer, path: str | Path, load_optimizer: bool = True) -> dict:
    """Restore weights (+ optimizer) and version from `path`. Returns the saved metadata."""
    path = Path(path)
    if not (path / WEIGHTS).is_file():
        raise UserError(f"no checkpoint at {path} (expected {WEIGHTS} there)")
    missing, unexpected = trainer.model.load_state_dict(load_file(str(path / WEIGHTS)), strict=False)
    if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
        raise UserError(
            f"checkpoint {path} does not match the model: missing={missing} unexpected={unexpected}"
        )
    if load_optimizer:
        trainer.optimizer.load_state_dict(torch.load(path / OPTIMIZER, weights_only=True))
    meta = json.loads((path / META).read_text())
    trainer.version = int(meta["version"])
    return meta
