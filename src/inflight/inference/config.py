"""The built-in engine's settings, apart from the engine: the run's config (`inflight.config`) holds them,
and reading a config must not import torch (a typo on the command line is answered in a second)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

RunnerChoice = Literal["auto", "fast", "hf"]


class BuiltinEngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(default=64, ge=1)  # cache rows = sequences decoded together
    # Prompt + completion: the cache length; a sequence that reaches it stops with "length".
    max_seq_len_tokens: int = Field(default=1024, ge=2)
    dtype: Literal["float32", "bfloat16"] = "float32"  # weights, activations and KV cache
    # the generator of requests without their own seed: torch takes a non-negative one below 2**63 here
    seed: int = Field(default=0, ge=0, lt=2**63)
    # What an update does to the K/V cache of sequences in flight (PipelineRL and OlmoRL always keep it):
    # "keep": they go on reading K/V computed by older weights; no pause, but every later token of theirs is
    #   generated on a stale prefix (counted: EngineMetrics.tokens_on_stale_kv).
    # "recompute": before the next decode step their prefixes are re-prefilled under the new weights,
    #   batched; the step loop pauses for that long, and their continuation is exactly what the new weights
    #   give for that prefix.
    kv_policy: Literal["keep", "recompute"] = "keep"
    # Recompute runs over consecutive rows in chunks of at most this many padded tokens (but at least one
    # row), which bounds the activation memory of a large batch of long sequences.
    recompute_chunk_tokens: int = Field(default=16384, ge=1)
    recent_updates_kept: int = Field(default=32, ge=0)  # UpdateRecords kept for metrics()
    # The forward pass. "fast": the engine's own (Qwen2/Qwen2.5, Qwen3, Llama incl. Llama 3 rope scaling,
    # Mistral). "hf": the model's Hugging Face forward with its KV cache: any causal LM, slower. "auto":
    # fast where it reproduces the model exactly, else hf (with a one-line warning saying why).
    runner: RunnerChoice = "auto"
    # Where weights, KV cache and sampling live: "cpu", "cuda", "cuda:N", or "auto" (cuda if there is one).
    device: str = "cpu"
    # Spare cache rows that keep the K/V of recently finished sequences (least recently used evicted), so
    # that a prompt beginning with one (a multi-turn episode's next turn) prefills only its new tokens;
    # valid for the same adapter and weights version only. Each row costs as much memory as a running
    # sequence's. Fast runner only (the hf runner ignores it). 0: off.
    prefix_cache_rows: int = Field(default=0, ge=0)
