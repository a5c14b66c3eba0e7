"""LoRA adapters as files for the engine's HTTP face: a PEFT adapter directory (`adapter_model.safetensors` +
`adapter_config.json`, what `peft` saves and vLLM's `load_lora_adapter` takes) <-> `AdapterUpdate`.

Owns the format checks a server makes before an adapter reaches its engine, each a ValueError naming the
file or field and the fix; whether the modules fit the model is the engine's check (`adapters.py`). Knows
nothing of HTTP or of which adapters are registered.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from inflight.types import AdapterUpdate

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
_PEFT_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_[AB]\.weight$")


def read_adapter_dir(path: Path, name: str, version: int) -> AdapterUpdate:
    """The adapter in PEFT directory `path`, registered as `name` at `version`.

    Scale is PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) with `use_rslora`. Per-module ranks or alphas
    (`rank_pattern`, `alpha_pattern`) and GPT-2-style `fan_in_fan_out` have no place in one AdapterUpdate
    and are refused rather than served wrongly.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_dir():
        raise ValueError(
            f"adapter path {str(path)!r} is not a directory; give a PEFT adapter directory holding "
            f"{ADAPTER_FILE} and {CONFIG_FILE}"
        )
    rank, scale = adapter_scale(_read_config(path / CONFIG_FILE))
    weights = path / ADAPTER_FILE
    if not weights.is_file():
        raise ValueError(f"adapter directory {str(path)!r} has no {ADAPTER_FILE} (only safetensors is read)")
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"cannot read {str(weights)!r} as a safetensors file: {exc}") from exc
    return AdapterUpdate(name=name, version=version, rank=rank, scale=scale, tensors=tensors)


def adapter_scale(config: dict[str, Any]) -> tuple[int, float]:
    """(rank, scale) from the fields of a PEFT `adapter_config.json`; ValueError names the field at fault."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{CONFIG_FILE}: peft_type is {peft_type!r}; only LORA adapters are served")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{CONFIG_FILE}: 'r' must be an integer >= 1, got {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"{CONFIG_FILE}: 'lora_alpha' must be a finite number, got {alpha!r}")
    for field in ("rank_pattern", "alpha_pattern"):
        if config.get(field):
            raise ValueError(
                f"{CONFIG_FILE}: {field} is set; per-module ranks or alphas are not supported, "
                "save the adapter with one r and one lora_alpha"
            )
    if config.get("fan_in_fan_out"):
        raise ValueError(f"{CONFIG_FILE}: fan_in_fan_out=true (GPT-2 Conv1D layers) is not supported")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def write_adapter_dir(path: Path, update: AdapterUpdate) -> None:
    """Write `update` as a PEFT adapter directory at `path`, atomically (a temp dir renamed into place), so
    a server reading `path` sees the whole adapter or none. lora_alpha is written as scale * r."""
    from safetensors.torch import save_file

    modules = sorted({m["module"] for key in update.tensors if (m := _PEFT_KEY.match(key))})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": update.rank,
        "lora_alpha": update.scale * update.rank,
        "use_rslora": False,
        "fan_in_fan_out": False,
        "bias": "none",
        "lora_dropout": 0.0,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}),
        "inference_mode": True,
    }
    tensors = {key: t.detach().to("cpu").contiguous() for key, t in update.tensors.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        save_file(tensors, str(tmp / ADAPTER_FILE))
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if path.exists():  # a rewrite of the same version (a retried sync): the new one wins
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _read_config(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise ValueError(
            f"adapter directory {str(file.parent)!r} has no {CONFIG_FILE} (PEFT's, with r and lora_alpha)"
        )
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {str(file)!r} as JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{str(file)!r} must hold a JSON object, got {type(config).__name__}")
    return config
