"""The internal request and result types between the service's HTTP layer and its compute engine.

Plain dataclasses, decoded from the wire by the HTTP layer and encoded back by it; the engine knows
nothing of HTTP, the database or futures. Import them from `inflight.api.engine`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoraSpec:
    rank: int = 32
    seed: int | None = None  # adapter init; None = random
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = False
    # alpha is not sent by Tinker; scale = 32 / rank like Tinker/SkyRL


@dataclass
class Datum:
    """Tinker's Datum after decoding."""

    input_tokens: list[int]  # [T] model_input flattened (encoded_text chunks only)
    # target_tokens, weights, logprobs, advantages: each flat [T] (len == len(input_tokens)). Position i of
    # target_tokens is predicted from input_tokens[:i+1]: the client pre-shifts, the engine never does.
    loss_fn_inputs: dict[str, list[float] | list[int]]


@dataclass
class ForwardBackwardJob:
    model_id: str
    data: list[Datum]
    loss_fn: str  # cross_entropy | importance_sampling | ppo | cispo
    loss_fn_config: dict[str, float] | None = None  # ppo/cispo: clip_low_threshold, clip_high_threshold
    backward: bool = True  # False: forward only (no gradient touched)


@dataclass
class ForwardBackwardOutput:
    # Per datum: "logprobs" [T] (len == len(target_tokens)) and "elementwise_loss" [T].
    loss_fn_outputs: list[dict[str, list[float]]]
    metrics: dict[str, float]  # every key "name:reduction"; at least "loss:sum"


@dataclass
class OptimStep:
    model_id: str
    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 = no clipping


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
