"""The trainer's job and result types for adapter training, as both front ends hand them in: an adapter's
shape (`LoraSpec`), Tinker's datums and forward_backward jobs, and an optimizer step's hyper-parameters.

Plain dataclasses; the service decodes them from the wire (`api/jobs.py`, `api/proto.py`), the pipeline
builds them from its config. Nothing here knows HTTP, models or files.
"""

from __future__ import annotations

from dataclasses import dataclass

from inflight.models.lora_targets import LORA_ALPHA


@dataclass
class LoraSpec:
    rank: int = 32
    seed: int | None = None  # adapter init; None = random
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = False
    # Tinker sends no alpha: scale = alpha / rank with alpha = 32, like Tinker and SkyRL.
    alpha: float = LORA_ALPHA
    # Module-name suffixes to train (e.g. ["q_proj", "v_proj"]); None = the train_* flags decide.
    target_modules: list[str] | None = None


@dataclass(frozen=True)
class ProvenanceSpan:
    """One run of a datum's rows and where it came from (Tinker's Prompt/SampledProvenanceSpan): positions
    [offset, offset + length) of the named sequence's sampled tokens, or of its request's prompt."""

    sampled: bool  # True: the sequence's sampled tokens; False: its request's prompt
    sequence_id: str  # the SampledSequence.sequence_id a sample answer gave
    offset: int
    length: int


@dataclass
class Datum:
    """Tinker's Datum after decoding."""

    input_tokens: list[int]  # [T] model_input flattened (encoded_text chunks only)
    # target_tokens, weights, logprobs, advantages: each flat [T] (len == len(input_tokens)). Position i of
    # target_tokens is predicted from input_tokens[:i+1]: the client pre-shifts, the trainer never does.
    loss_fn_inputs: dict[str, list[float] | list[int]]
    # Provenance of the rows: consecutive runs tiling target_tokens (lengths sum to T), or None. Only
    # stable_reinforce reads it (which rows were sampled); the model_input spans are checked and dropped.
    loss_fn_input_spans: list[ProvenanceSpan] | None = None


@dataclass
class ForwardBackwardJob:
    model_id: str  # the adapter the job trains (or, with backward=False, reads)
    data: list[Datum]
    loss_fn: str  # a name in inflight.losses.LOSSES (Tinker's)
    loss_fn_config: dict[str, float] | None = None  # the loss's keys (tinker_losses.CONFIG_KEYS)
    backward: bool = True  # False: forward only (no gradient touched)


@dataclass
class ForwardBackwardOutput:
    # Per datum: "logprobs" [T] (len == len(target_tokens)) and "elementwise_loss" [T].
    loss_fn_outputs: list[dict[str, list[float]]]
    metrics: dict[str, float]  # every key "name:reduction"; at least "loss:sum"


@dataclass
class OptimStep:
    """One AdamW step's hyper-parameters (the service's clients send them per step)."""

    model_id: str  # the adapter to step ("" for the full-parameter model)
    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 = no clipping
