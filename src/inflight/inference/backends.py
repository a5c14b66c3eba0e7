"""The engines `inflight serve-engine` can serve (`--backend`): what the server needs of one
(`ServedEngine`) and how each is built from a model directory with the stop ids its chat route uses.
Heavy imports (torch, transformers, vLLM) happen only in the builder of the backend asked for.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, Protocol

from inflight.inference.builtin import EngineMetrics
from inflight.inference.engine import SteppedEngine
from inflight.models.chat_template import generation_stop_ids, generation_stop_ids_of

Backend = Literal["builtin", "vllm"]


@dataclass(frozen=True)
class VllmOptions:
    """What `serve-engine` sets of vLLM besides what both backends take (see VllmEngineConfig)."""

    logprobs_kind: Literal["sampled", "raw"] = "sampled"  # the one kind it reports under any sampling
    max_lora_rank: int = 16
    max_prompt_logprobs: int = 20


class _ServedConfig(Protocol):
    @property
    def max_seq_len_tokens(self) -> int: ...


class ServedEngine(SteppedEngine, Protocol):
    """What the server needs of a backend besides the SteppedEngine protocol: the built-in engine and
    `vllm_engine.VllmEngine` both provide it (the step loop polls `has_pending_update`; /metrics, /health and
    the update routes read `metrics()`; the OpenAI routes read `config.max_seq_len_tokens`; /health reports
    `lora_modules()`)."""

    @property
    def config(self) -> _ServedConfig: ...

    def has_pending_update(self) -> bool: ...

    def metrics(self) -> EngineMetrics: ...

    def lora_modules(self) -> list[str] | None:
        """The modules (last name part, e.g. "q_proj", "lm_head") an adapter may adapt; None: any linear."""
        ...


def load_backend(
    backend: Backend,
    model: str,
    max_batch_size: int,
    max_seq_len_tokens: int | None,
    dtype: str,
    kv_policy: str,
    device: str = "cpu",
    vllm: VllmOptions | None = None,
) -> tuple[ServedEngine, tuple[int, ...]]:
    """The engine of `backend` over `model` (a directory or hub id) and the ids generation stops at (the
    model's generation config's EOS ids); `kv_policy` and `device` are the built-in engine's only (vLLM
    places itself), `vllm` vLLM's only."""
    if backend == "vllm":
        return _vllm_engine(model, max_batch_size, max_seq_len_tokens, dtype, vllm or VllmOptions())
    return _builtin_engine(model, max_batch_size, max_seq_len_tokens, dtype, kv_policy, device)


def _builtin_engine(
    model: str,
    max_batch_size: int,
    max_seq_len_tokens: int | None,
    dtype: str,
    kv_policy: str,
    device: str,
) -> tuple[ServedEngine, tuple[int, ...]]:
    from inflight.inference.builtin import BuiltinEngine, BuiltinEngineConfig
    from inflight.models import load_model, load_tokenizer

    hf_model = load_model(model)
    if max_seq_len_tokens is None:  # the cache is preallocated: a modest default, capped by the model
        max_seq_len_tokens = min(1024, int(getattr(hf_model.config, "max_position_embeddings", 1024)))
    config = BuiltinEngineConfig.model_validate(
        dict(
            max_batch_size=max_batch_size,
            max_seq_len_tokens=max_seq_len_tokens,
            dtype=dtype,
            kv_policy=kv_policy,
            device=device,
        )
    )
    engine = BuiltinEngine(hf_model, load_tokenizer(model), config)
    return engine, generation_stop_ids(hf_model)  # the engine holds its own copy of the weights


def _vllm_engine(
    model: str, max_batch_size: int, max_seq_len_tokens: int | None, dtype: str, options: VllmOptions
) -> tuple[ServedEngine, tuple[int, ...]]:
    from transformers import AutoConfig

    from inflight.inference.vllm_engine import VllmEngine, VllmEngineConfig  # lazy: imports vllm

    # The configs only, not the weights (vLLM loads those): enough for the stop ids and the context.
    hf_config = AutoConfig.from_pretrained(model)
    stop_ids = generation_stop_ids_of(model)
    if max_seq_len_tokens is None:  # the same default as the built-in engine's
        max_seq_len_tokens = min(1024, int(getattr(hf_config, "max_position_embeddings", 1024)))
    config = VllmEngineConfig.model_validate(
        dict(
            max_batch_size=max_batch_size,
            max_seq_len_tokens=max_seq_len_tokens,
            dtype="float32" if dtype == "auto" else dtype,
            **asdict(options),
        )
    )
    return VllmEngine(model, config), stop_ids
