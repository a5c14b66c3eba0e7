"""Load a causal LM and its tokenizer from a local Hugging Face directory or a hub id, one code path.

Models are returned as loaded (train/eval mode, device and threads are the caller's decisions).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from inflight.errors import UserError
from inflight.models.paths import build_hint, resolve
from inflight.types import DtypeName


def native_bfloat16(device: torch.device) -> bool:
    """Whether `device` multiplies bfloat16 matrices in hardware: a CUDA GPU that supports it, or a CPU with
    AVX512-BF16 or AMX-BF16 (elsewhere PyTorch emulates bfloat16 matmuls, slower than float32)."""
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        capabilities = torch.cpu.get_capabilities()
        return bool(capabilities.get("avx512_bf16") or capabilities.get("amx_bf16"))
    return False


def resolve_dtype(name: DtypeName, device: torch.device) -> torch.dtype:
    """The weight dtype `name` means on `device`: "auto" is bfloat16 where `native_bfloat16(device)`, else
    float32 (as vLLM's "auto" runs a float32 checkpoint in the platform's half precision)."""
    if name == "auto":
        return torch.bfloat16 if native_bfloat16(device) else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _load_error(name: str, exc: OSError) -> UserError:
    # A bare "org/name" that is neither a local dir nor reachable on the hub ends here; say both readings.
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return UserError(
        f"cannot load {name!r} as a local model directory or a Hugging Face hub id ({reason}); "
        f"for a local tiny model, {build_hint('DIR')}"
    )


@contextmanager
def hf_progress_bars(shown: bool) -> Iterator[None]:
    """Within it, transformers' progress bars ("Loading weights", "Writing model shards", a hub download's)
    only when `shown` and stderr is a terminal: elsewhere (a log file, a pipe, CI) each carriage-return
    redraw is noise. Its switches (transformers' and huggingface_hub's, which it sets together) are
    process-wide: put back as they were."""
    quiet = hf_logging.is_progress_bar_enabled() and not (shown and sys.stderr.isatty())
    hub_was_off = are_progress_bars_disabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet:
            hf_logging.enable_progress_bar()
            if hub_was_off:
                disable_progress_bars()


def load_model(
    name_or_path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = True
) -> PreTrainedModel:
    """A causal LM from a local directory (safetensors) or a hub id, with weights in `dtype`.

    transformers puts the model in eval mode; call `.train()` to train it. `progress`: show transformers'
    loading bar (a run's `progress=false` hides it); never where stderr is not a terminal.
    """
    name = resolve(name_or_path)
    try:
        with hf_progress_bars(progress):
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    except OSError as exc:
        raise _load_error(name, exc) from exc
    except SafetensorError as exc:  # a truncated download or an interrupted save
        # The commands' preflight names the file before anything loads; this covers what it does not see
        # (a hub id's cached files, a file damaged since): the file when it is local, else the model.
        if Path(name).is_dir():
            from inflight.preflight import check_weight_files

            check_weight_files(Path(name))
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"the weights of {name!r} are incomplete or corrupt ({reason}): download or build the model again"
        ) from exc
    return model


# The files a tokenizer is saved as (fast, SentencePiece, BPE and WordPiece vocabularies). A directory with
# none of them still "loads": transformers builds an empty tokenizer of the model's type, whose first
# failure (no chat template, every text one unknown token) names anything but the missing files.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
)


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved with a model (tokenizer.json + tokenizer_config.json, chat template included)."""
    name = resolve(name_or_path)
    if Path(name).is_dir() and not any((Path(name) / file).is_file() for file in TOKENIZER_FILES):
        raise UserError(
            f"model directory {name!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): save the "
            "model's tokenizer into it (`tokenizer.save_pretrained(DIR)`), or name a directory that has one"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except OSError as exc:
        raise _load_error(name, exc) from exc
    return tokenizer


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameter elements (a tied matrix counts once)."""
    return sum(parameter.numel() for parameter in model.parameters())
