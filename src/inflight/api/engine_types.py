"""The internal request and result types between the service's HTTP layer and its compute engine.

Plain dataclasses, decoded from the wire by the HTTP layer and encoded back by it; the engine knows
nothing of HTTP, the database or futures. Import them from `inflight.api.engine`. The training types are
the trainer's own (`inflight.trainer.types`), re-exported here so the HTTP layer has one place to look.
"""

from __future__ import annotations

from dataclasses import dataclass

from inflight.trainer.types import Datum, ForwardBackwardJob, ForwardBackwardOutput, LoraSpec, OptimStep

__all__ = [
    "Datum",
    "ForwardBackwardJob",
    "ForwardBackwardOutput",
    "LoraSpec",
    "OptimStep",
    "SampleJob",
    "SampleOutput",
    "SampledSequence",
]


@dataclass
class SampleJob:
    # None = bare base model; else an adapter key: a model_id (its current weights) or a sampler-checkpoint
    # key registered with load_sampler_weights / snapshot_sampler_weights.
    weights: str | None
    base_model: str
    prompt_tokens: list[int]
    num_samples: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    seed: int | None = None  # sample i uses seed + i
    stop: list[str] | list[int] | None = None  # None = stop at EOS; [] = never stop; strings / token ids
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0


@dataclass
class SampledSequence:
    tokens: list[int]  # [N] generated tokens; a stop token or the tokens of a stop string are kept
    logprobs: list[float]  # [N] log-softmax of the raw logits (temperature 1, no truncation) at each token
    stop_reason: str  # "stop" | "length"


@dataclass
class SampleOutput:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None  # [P] [None, lp1, lp2, ...] when asked
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None  # [P] [None, [(id, lp), ..]]
