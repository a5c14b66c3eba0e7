"""Causal LMs and tokenizers: load any Hugging Face directory or hub id, or build a tiny one locally.

Importing this package imports transformers (seconds); the CLI imports it lazily.
"""

from inflight.models.loader import count_parameters, load_model, load_tokenizer
from inflight.models.tiny import PRESETS, TinyPreset, build_tiny

__all__ = ["PRESETS", "TinyPreset", "build_tiny", "count_parameters", "load_model", "load_tokenizer"]
