"""Trainer checkpoints: the policy's files, optimizer state and the step, durable against a kill.

The policy's files are the one format of its kind: a full model is a Hugging Face directory
(model.safetensors + config.json: `AutoModelForCausalLM.from_pretrained` loads it) with optimizer.pt; a
LoRA adapter is a PEFT directory (adapter_model.safetensors + adapter_config.json: `PeftModel.from_pretrained`
loads it) with optimizer.safetensors, the service's layout (`adapter_checkpoint.py`).

A checkpoint is a directory whose metadata file (trainer_state.json, with every other file's size) is
written last and fsynced, so its presence proves the checkpoint complete. A save writes `NAME.tmp`, then
renames `NAME` -> `NAME.old` and `NAME.tmp` -> `NAME`, then deletes `NAME.old`. Whatever instant a kill
stops it, `find_checkpoint` returns the newest complete one (`NAME.tmp` when the kill came between its
renames), and the next save first moves that one back into place.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

from inflight.durable import fsync_path
from inflight.errors import UserError
from inflight.models.lora import lora_layers
from inflight.models.lora_adapter import split_peft_key
from inflight.trainer.adapter_checkpoint import ADAPTER_FILE
from inflight.trainer.policy import OPTIMIZER, WEIGHTS

if TYPE_CHECKING:  # trainer.py imports this module
    import torch

    from inflight.trainer.trainer import Trainer

META = "trainer_state.json"
_OPTIMIZER_FILES = (OPTIMIZER, "optimizer.safetensors")  # a full model's, a LoRA adapter's
_FILES_KEY = "files"  # in META: {file name: bytes}, the proof that the files beside it are whole


def _tmp(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def _old(path: Path) -> Path:
    return path.with_name(path.name + ".old")


def _read_meta(path: Path) -> dict[str, Any] | None:
    """The metadata of a complete checkpoint at `path`, or None for an absent, partial or half-deleted one."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict):
        return None
    # Checkpoints from before the size record: their directory was renamed into place whole.
    sizes = meta.get(_FILES_KEY, {WEIGHTS: None, OPTIMIZER: None})
    if not isinstance(sizes, dict) or not sizes:
        return None
    for name, size in sizes.items():
        file = path / name
        if not file.is_file() or (size is not None and file.stat().st_size != size):
            return None
    return meta


def find_checkpoint(path: str | Path) -> Path | None:
    """The newest complete checkpoint a save to `path` left, or None when there is none.

    Raises UserError when `path` itself exists but is not a complete checkpoint: a save never leaves it so,
    something else damaged it, and resuming from an older one or from step 0 would hide that.
    """
    path = Path(path)
    if _read_meta(_tmp(path)) is not None:  # written whole, killed before or between the renames
        return _tmp(path)
    if path.exists():
        if _read_meta(path) is None:
            raise UserError(
                f"checkpoint {path} is incomplete or corrupt (no valid {META} matching its files): "
                "move it away to start this run from step 0"
            )
        return path
    if _read_meta(_old(path)) is not None:  # only if `path` was removed by hand
        return _old(path)
    return None


def resume_checkpoint(trainer: Trainer, path: str | Path) -> dict[str, Any]:
    """Load the newest complete checkpoint at `path` (see `find_checkpoint`) into `trainer`; returns its
    metadata, or {} when there is none to resume from."""
    found = find_checkpoint(path)
    return load_checkpoint(trainer, found) if found is not None else {}


def check_resumable(path: str | Path, model: torch.nn.Module, lora_rank: int) -> None:
    """UserError when the newest checkpoint at `path` cannot continue training `model` with
    trainer.lora_rank=`lora_rank`: it holds the other kind of weights (a LoRA adapter, a full model), a
    full model of other tensors (names or shapes), or an adapter of another base model or rank. `model`
    is as loaded, before LoRA wraps its layers. Nothing without a checkpoint. Reads file names and the
    safetensors header only, so a run asks before it writes into its run directory; `load_checkpoint` asks
    the same again (an adapter's tensors: as they load)."""
    found = find_checkpoint(path)
    if found is None:
        return
    _check_kind(found, lora_rank)
    try:
        if lora_rank:
            _check_adapter_fits(model, found, lora_rank)
        else:
            _check_same_model(model, found)
    except (SafetensorError, OSError) as e:  # a header damaged since the save
        raise _unreadable(found, e) from None


def checkpoint_step(path: str | Path) -> int:
    """The step a run resuming from `path` starts at: 0 without a checkpoint."""
    found = find_checkpoint(path)
    meta = _read_meta(found) if found is not None else None
    return int(meta.get("step", 0)) if meta is not None else 0


def _settle(path: Path) -> None:
    """Move a complete `NAME.tmp` (left by a save killed before or between its renames) into `NAME`'s place:
    the save about to start deletes `NAME.tmp`, and it may be the newest checkpoint there is."""
    tmp, old = _tmp(path), _old(path)
    if _read_meta(tmp) is None:
        return
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)


def save_checkpoint(
    trainer: Trainer, path: str | Path, extra: dict | None = None, optimizer: bool = True
) -> Path:
    """Write weights + optimizer + version to `path`, replacing the checkpoint there only once the new one
    is complete (see the module docstring for the order of the writes). `optimizer=False` leaves the
    optimizer's state out (a finished warm-up's weights: nothing trains on with that optimizer, and its
    state is twice the model's size); load such a checkpoint with `load_optimizer=False`."""
    path = Path(path)
    tmp, old = _tmp(path), _old(path)
    _settle(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    written = trainer.policy.save(tmp)
    if not optimizer:
        for name in [n for n in written if n in _OPTIMIZER_FILES]:
            (tmp / name).unlink()
            written.remove(name)
    sizes = {name: (tmp / name).stat().st_size for name in written}
    for name in sizes:
        fsync_path(tmp / name)
    # Last: until this file is whole, `find_checkpoint` ignores the directory.
    meta = {"version": trainer.version, **(extra or {}), _FILES_KEY: sizes}
    with open(tmp / META, "w") as f:
        f.write(json.dumps(meta, indent=2))
        f.flush()
        os.fsync(f.fileno())
    fsync_path(tmp)
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_path(path.parent)
    shutil.rmtree(old, ignore_errors=True)
    return path


def load_checkpoint(trainer: Trainer, path: str | Path, load_optimizer: bool = True) -> dict:
    """Restore weights (+ optimizer) and version from `path`. Returns the saved metadata."""
    path = Path(path)
    lora_rank = trainer.config.lora_rank
    _check_kind(path, lora_rank)
    try:
        model = getattr(trainer.policy, "model", None)
        if not lora_rank and model is not None:  # before any tensor loads: one line, not every key
            _check_same_model(model, path)
        meta = json.loads((path / META).read_text())
        trainer.policy.load(path, load_optimizer)
    # What a damaged file raises: safetensors' header check, torch.load's zip reader and unpickler, json.
    except (SafetensorError, OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise _unreadable(path, e) from None
    trainer.version = int(meta["version"])
    meta.pop(_FILES_KEY, None)
    return meta


def _unreadable(path: Path, error: BaseException) -> UserError:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return UserError(
        f"checkpoint {path} cannot be read ({reason}): move it away to start this run from step 0"
    )


def _check_kind(path: Path, lora_rank: int) -> None:
    """UserError unless `path` holds the policy's files of a run with trainer.lora_rank=`lora_rank`."""
    lora = lora_rank > 0
    expected, other = (ADAPTER_FILE, WEIGHTS) if lora else (WEIGHTS, ADAPTER_FILE)
    if (path / expected).is_file():
        return
    if (path / other).is_file():
        kind = "a full model" if lora else "a LoRA adapter"
        raise UserError(
            f"checkpoint {path} holds {kind}, but trainer.lora_rank={lora_rank}: resume with the run's own "
            "trainer settings, or move the checkpoint away to start from step 0"
        )
    raise UserError(f"no checkpoint at {path} (expected {expected} there)")


class OtherModelError(UserError):
    """A full-model checkpoint whose tensors (names or shapes) are not the model's: it was trained from
    another model. Its own type, so that a caller knowing which key chose the model can name that key."""


def _check_same_model(model: torch.nn.Module, path: Path) -> None:
    """OtherModelError when the full-model checkpoint at `path` holds other tensors (names or shapes) than
    `model`: it was trained from another model. Reads only the safetensors header."""
    ours = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    with safe_open(str(path / WEIGHTS), "pt") as f:
        theirs = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    # A tied output layer may be saved under the embedding's name only (as `policy.load` allows).
    differ = sorted(
        {n for n in ours if n not in theirs and not n.endswith("lm_head.weight")}
        | {n for n in theirs if n not in ours}
        | {n for n in ours if n in theirs and ours[n] != theirs[n]}
    )
    if differ:
        example = differ[0]
        shapes = f" {theirs.get(example, 'absent')} there, {ours.get(example, 'absent')} here"
        raise OtherModelError(
            f"checkpoint {path} was trained from a different model ({len(differ)} of its tensors differ, "
            f"e.g. {example}:{shapes}): resume with the run's own model.path, or move {path} away"
        )


def _check_adapter_fits(model: torch.nn.Module, path: Path, lora_rank: int) -> None:
    """OtherModelError when the LoRA adapter at `path` adapts layers that `model` (unwrapped) lacks, or of
    other shapes: it was trained on another base model; UserError when its rank is not `lora_rank`. Reads
    only the safetensors header."""
    ours = {name: (layer.in_features, layer.out_features) for name, layer in lora_layers(model)}
    with safe_open(str(path / ADAPTER_FILE), "pt") as f:
        theirs = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    differ: list[tuple[str, tuple[int, ...], tuple[int, ...] | str]] = []
    ranks: set[int] = set()
    for key, shape in sorted(theirs.items()):
        parsed = split_peft_key(key)
        if parsed is None or parsed[0] not in ours or len(shape) != 2:
            differ.append((key, shape, "absent"))
            continue
        (fan_in, fan_out), which = ours[parsed[0]], parsed[1]
        rank = shape[0] if which == "A" else shape[1]
        expected = (rank, fan_in) if which == "A" else (fan_out, rank)
        ranks.add(rank)
        if shape != expected:
            differ.append((key, shape, expected))
    if differ:
        key, there, here = differ[0]
        raise OtherModelError(
            f"checkpoint {path} holds a LoRA adapter of a different base model ({len(differ)} of its tensors "
            f"do not fit, e.g. {key}: {there} there, {here} here): resume with the run's own model.path, or "
            f"move {path} away"
        )
    if ranks and ranks != {lora_rank}:
        rank = max(ranks)
        raise UserError(
            f"checkpoint {path} holds a rank-{rank} LoRA adapter, but trainer.lora_rank={lora_rank}: resume "
            f"with trainer.lora_rank={rank}, or move the checkpoint away to start from step 0"
        )
