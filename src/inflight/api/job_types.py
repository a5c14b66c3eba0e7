"""The service's internal type layer (between the wire schemas and the database rows): the jobs and results
the HTTP layer hands to the compute (`compute.py`, `sampler.py`) and gets back.

Plain dataclasses, decoded from the wire by the HTTP layer and encoded back by it; the compute knows
nothing of HTTP, the database or futures. The training types are the trainer's own
(`inflight.trainer.types`), re-exported here so the HTTP layer has one place to look.
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
    # None = the bare base model; else sampler weights registered with the engine (`Sampler.set_adapter`):
    # a snapshot of a model's adapter, or a sampler checkpoint.
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
