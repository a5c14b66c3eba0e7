"""Adapter checkpoints on disk, the one format of every LoRA adapter inflight saves: a directory that
`peft.PeftModel.from_pretrained` loads, plus AdamW state when asked.

Layout of one checkpoint directory:
  adapter_model.safetensors   A/B per module under PEFT names (float32)
  adapter_config.json         PEFT's LoraConfig fields (r, lora_alpha, target_modules, base model)
  optimizer.safetensors       with optimizer state: AdamW exp_avg / exp_avg_sq / step per parameter
  inflight_state.json         the service's record to rebuild it: kind, base model name, LoRA spec
The pipeline's run checkpoint (`checkpoint.py`) writes the first three with `write_adapter_files` inside its
own crash-safe directory. Knows nothing of requests or which adapter is live; callers decide what to save
and where.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from inflight.errors import UserError
from inflight.models.lora_adapter import LoraAdapter, target_suffixes
from inflight.trainer.types import LoraSpec

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "inflight_state.json"
FORMAT_VERSION = 1


@dataclass
class CheckpointMeta:
    kind: Literal["state", "sampler"]  # save_state (adapter + optimizer) or save_weights_for_sampler
    base_model: str  # the engine's name of the base model
    lora: LoraSpec
    has_optimizer: bool
    optimizer_steps: int


def write_checkpoint(
    path: Path,
    adapter: LoraAdapter,
    meta: CheckpointMeta,
    base_source: str,
    optimizer: torch.optim.Optimizer | None,
) -> int:
    """Write the checkpoint directory atomically (a temp dir renamed into place); returns bytes written."""

    def write(tmp: Path) -> None:
        write_adapter_files(tmp, adapter, base_source, optimizer)
        state = {"format_version": FORMAT_VERSION, **dataclasses.asdict(meta)}
        _write_json(tmp / STATE_FILE, state)

    return _atomic_dir(Path(path), write)


def write_adapter_files(
    directory: Path, adapter: LoraAdapter, base_source: str, optimizer: torch.optim.Optimizer | None
) -> list[str]:
    """The PEFT adapter (and the optimizer's moments, when given) into `directory`; returns the file names."""
    save_file(adapter.state_dict(), str(directory / ADAPTER_FILE))
    _write_json(directory / CONFIG_FILE, _peft_config(adapter, base_source))
    if optimizer is None:
        return [ADAPTER_FILE, CONFIG_FILE]
    save_file(_optimizer_tensors(adapter, optimizer), str(directory / OPTIMIZER_FILE))
    return [ADAPTER_FILE, CONFIG_FILE, OPTIMIZER_FILE]


def read_meta(path: Path) -> CheckpointMeta:
    """The checkpoint's metadata; a UserError says what is wrong with the directory."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"checkpoint {str(path)!r} does not exist or is not a directory")
    try:
        state = json.loads((path / STATE_FILE).read_text())
        lora = LoraSpec(**state["lora"])
        meta = CheckpointMeta(
            kind=state["kind"],
            base_model=state["base_model"],
            lora=lora,
            has_optimizer=bool(state["has_optimizer"]),
            optimizer_steps=int(state["optimizer_steps"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"checkpoint {str(path)!r} has no readable {STATE_FILE}: {exc}") from exc
    if state.get("format_version") != FORMAT_VERSION:
        raise UserError(
            f"checkpoint {str(path)!r} has format_version {state.get('format_version')!r}; "
            f"this engine reads {FORMAT_VERSION}"
        )
    return meta


def read_adapter_tensors(path: Path) -> dict[str, Tensor]:
    return _load(Path(path) / ADAPTER_FILE)


def optimizer_state_dict(path: Path, adapter: LoraAdapter, optimizer: torch.optim.Optimizer) -> dict:
    """`optimizer.load_state_dict` input rebuilt from the checkpoint's moments, in `adapter.parameters()`
    order, with the optimizer's current hyper-parameters (each optim_step sets its own anyway)."""
    tensors = _load(Path(path) / OPTIMIZER_FILE)
    state: dict[int, dict[str, Tensor]] = {}
    for index, (key, param) in enumerate(adapter.named_parameters()):
        if f"{key}.step" not in tensors:
            continue  # never stepped (the checkpoint was saved before the first optim_step)
        moments = {name: tensors[f"{key}.{name}"] for name in ("exp_avg", "exp_avg_sq")}
        for name, moment in moments.items():
            if moment.shape != param.shape:
                raise UserError(f"checkpoint {str(path)!r}: {key}.{name} has shape {tuple(moment.shape)}")
        state[index] = {"step": tensors[f"{key}.step"].reshape(()).float(), **moments}
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    group["params"] = list(range(len(adapter.parameters())))
    return {"state": state, "param_groups": [group]}


def _optimizer_tensors(adapter: LoraAdapter, optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
    tensors = {}
    for key, param in adapter.named_parameters():
        state = optimizer.state.get(param)
        if not state:
            continue
        tensors[f"{key}.step"] = torch.as_tensor(state["step"], dtype=torch.float64).reshape(1).cpu()
        for name in ("exp_avg", "exp_avg_sq"):
            tensors[f"{key}.{name}"] = state[name].detach().to("cpu", torch.float32, copy=True)
    return tensors


def _peft_config(adapter: LoraAdapter, base_source: str) -> dict[str, Any]:
    # The fields PEFT's LoraConfig reads, so `PeftModel.from_pretrained(base, dir)` can load the weights.
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "target_modules": target_suffixes(adapter.modules),
        "base_model_name_or_path": base_source,
        "inference_mode": True,
    }


def _load(file: Path) -> dict[str, Tensor]:
    if not file.is_file():
        raise UserError(f"checkpoint file {str(file)!r} is missing")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as exc:
        raise UserError(f"checkpoint file {str(file)!r} is unreadable: {exc}") from exc


def _write_json(file: Path, value: dict[str, Any]) -> None:
    file.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def _atomic_dir(path: Path, write: Callable[[Path], None]) -> int:
    """Run `write` into a fresh temp dir next to `path`, fsync it, then rename it to `path`.

    A reader sees the old checkpoint or the complete new one, never a half-written directory. An existing
    `path` is replaced (whether overwriting is allowed is the caller's decision).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private (0700); a checkpoint is an ordinary directory
        write(tmp)
        size = 0
        for file in tmp.iterdir():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
            size += file.stat().st_size
        if path.exists():
            old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex}")
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return size
