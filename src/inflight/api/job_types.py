"""The service's internal type layer (between the wire schemas and the database rows): the jobs and results
the HTTP layer hands to the compute (`compute.py`, `sampler.py`) and gets back.

Plain dataclasses, decoded from the wire by the HTTP layer and encoded back by it; the compute knows
nothing of HTTP, the database or futures. The training types are the trainer's own
(`inflight.trainer.types`), re-exported here so the HTTP layer has one place to look.
"""

from __future__ import annotations

from dataclasses import dataclass

from inflight.trainer.types import (
    Datum,
    ForwardBackwardJob,
    ForwardBackwardOutput,
    LoraSpec,
    OptimStep,
    ProvenanceSpan,
)

__all__ = [
    "CsrLayout",
    "Datum",
    "ForwardBackwardJob",
    "ForwardBackwardOutput",
    "LoraSpec",
    "OptimStep",
    "PromptTargets",
    "ProvenanceSpan",
    "SampleJob",
    "SampleOutput",
    "SampledSequence",
    "TargetLogprobs",
]


@dataclass(frozen=True)
class CsrLayout:
    """Where a sparse 2-D tensor's listed cells are (compressed sparse rows): kept from a request so that the
    answer has the same layout."""

    crow_indices: list[int]  # [rows + 1] row i's cells are col_indices[crow[i]:crow[i + 1]]
    col_indices: list[int]  # [nnz]


@dataclass(frozen=True)
class PromptTargets:
    """Tinker's target_prompt_logprobs: token ids to score at prompt positions 1..P-1."""

    ids: list[list[int]]  # [P-1][K] row i: ids scored at prompt position i + 1; -1 asks nothing
    layout: CsrLayout | None = None  # the request's sparse layout (unlisted cells are -1); None: dense


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
    topk_sample_logprobs: int = 0  # the k most likely at each generated position
    target_prompt: PromptTargets | None = None
    prompt_alt_tokens_k: int = 0  # draws at each prompt position 1..P-1, at the job's temperature


@dataclass
class SampledSequence:
    tokens: list[int]  # [N] generated tokens; a stop token or the tokens of a stop string are kept
    logprobs: list[float]  # [N] log-softmax of the raw logits (temperature 1, no truncation) at each token
    stop_reason: str  # "stop" | "length"
    topk_logprobs: list[list[tuple[int, float]]] | None = None  # [N] k most likely (id, raw lp) when asked


@dataclass
class TargetLogprobs:
    values: list[list[float]]  # [P-1][K] raw logprob of each target id; 0.0 where it was -1
    layout: CsrLayout | None  # the request's: the answer lists the same cells


@dataclass
class SampleOutput:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None  # [P] [None, lp1, lp2, ...] when asked
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None  # [P] [None, [(id, lp), ..]]
    target_prompt_logprobs: TargetLogprobs | None = None
    prompt_alt_tokens: list[list[tuple[int, float]]] | None = None  # [P-1][k] (id, raw logprob) draws
