"""Causal LMs and tokenizers: load any Hugging Face directory or hub id, or build a tiny one locally.

Its exports load on first use: `load_model` and the rest import transformers (seconds), while its light
modules (`lora_targets`, `device`) are imported by the run's config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inflight.lazy import lazy_exports

if TYPE_CHECKING:
    from inflight.models.loader import count_parameters, load_model, load_tokenizer
    from inflight.models.tiny import PRESETS, TinyPreset, build_tiny

# Loaded on first use (lazy.py): `inflight.config` imports light modules of this package.
__getattr__ = lazy_exports(
    __name__,
    {
        "count_parameters": ".loader",
        "load_model": ".loader",
        "load_tokenizer": ".loader",
        "PRESETS": ".tiny",
        "TinyPreset": ".tiny",
        "build_tiny": ".tiny",
    },
)

__all__ = ["PRESETS", "TinyPreset", "build_tiny", "count_parameters", "load_model", "load_tokenizer"]
