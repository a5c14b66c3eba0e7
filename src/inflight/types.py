"""Typed containers that cross component boundaries (engine, rollouts, buffer, trainer).

Imports nothing from the project. Per-token lists are aligned with the token stream they describe;
shape notes use T for tokens of one sequence.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]
# Which log-probability the engine reports for each sampled token (docs/architecture.md, "Logprobs"):
# "sampled": under the distribution the token was drawn from (temperature, then top-k/top-p truncation and
#   renormalisation); the pipeline's behaviour logprobs, what its importance ratios need.
# "raw": log_softmax of the model's logits at temperature 1, untruncated; Tinker's wire semantics.
LogprobKind = Literal["sampled", "raw"]
# A model's weight precision; "auto": bfloat16 where the device multiplies it natively, else float32.
DtypeName = Literal["auto", "float32", "bfloat16"]


# vLLM's rule: a temperature below this samples greedily (dividing logits by it overflows float32).
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled. Validated on construction; errors name the field."""

    max_tokens: int = 64
    temperature: float = 1.0  # 0 (or below MIN_TEMPERATURE) = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None  # same seed + prompt + weights -> same tokens
    stop: tuple[str, ...] = ()  # stop when the decoded completion contains one of these
    stop_token_ids: tuple[int, ...] = ()  # stop after sampling one of these (kept in the output)
    logprobs_kind: LogprobKind = "sampled"  # which logprob Completion.logprobs holds
    # > 0: Completion.topk_logprobs holds the k most likely (token id, logprob) at each generated position,
    # in the same kind as Completion.logprobs
    topk_logprobs: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.topk_logprobs < 0:
            raise ValueError(
                f"SamplingParams.topk_logprobs must be >= 0 (0 = none), got {self.topk_logprobs}"
            )
        # Accept lists from callers but store tuples so the params stay hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        """The argmax at every step; top-k and top-p change nothing then."""
        return self.temperature < MIN_TEMPERATURE

    @property
    def truncates_distribution(self) -> bool:
        """True when top-p/top-k change the behaviour distribution away from softmax(logits / T)."""
        return not self.greedy and (self.top_p < 1.0 or self.top_k > 0)


def new_id() -> str:
    return uuid.uuid4().hex


@dataclass
class SampleRequest:
    prompt_token_ids: list[int]  # [P]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=new_id)
    adapter: str | None = None  # a LoRA adapter registered with the engine (set_adapter); None = base weights
    # Log-probabilities of the prompt's own tokens (temperature 1, untruncated), e.g. Tinker's
    # compute_logprobs: the log-prob of each prompt token, and the k most likely tokens at each position.
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0  # 0 = none
    # [P-1][K] token ids to score, row i at prompt position i + 1 (the candidates for prompt[i + 1]); -1 asks
    # nothing. Tinker's target_prompt_logprobs.
    target_prompt_ids: list[list[int]] | None = None
    # > 0: that many draws, with replacement, from softmax(logits / temperature) at each prompt position
    # 1..P-1 (temperature 0: the argmax each time); a seeded request draws reproducibly, from a generator
    # of its own, so its sampled tokens are the same with or without them. Tinker's prompt_alt_tokens_k.
    prompt_alt_tokens_k: int = 0


@dataclass
class Completion:
    """What the engine produced for one request."""

    request_id: str
    prompt_token_ids: list[int]  # [P]
    token_ids: list[int]  # [T] generated tokens (a stop token is included)
    logprobs: list[float]  # [T] log-prob of each sampled token under the distribution it was sampled from
    versions: list[int]  # [T] policy version of the weights that produced each token
    finish_reason: FinishReason
    text: str | None = None  # decoded completion, when the engine has a tokenizer
    # [P] when asked: log p(prompt_t | prompt_<t) at temperature 1; position 0 has no prefix and is NaN.
    prompt_logprobs: list[float] | None = None
    # [P] when asked: the k most likely (token id, logprob) at each position, most likely first; [0] is [].
    topk_prompt_logprobs: list[list[tuple[int, float]]] | None = None
    # [T] when params.topk_logprobs > 0: up to k (token id, logprob) at each generated position, most likely
    # first, in params.logprobs_kind's kind; tokens the distribution cannot draw (outside top-k/top-p) are
    # left out, so a row may hold fewer than k.
    topk_logprobs: list[list[tuple[int, float]]] | None = None
    # [P-1][K] when target_prompt_ids was given: log p(id | prompt_<=i) at temperature 1; 0.0 where id is -1.
    target_prompt_logprobs: list[list[float]] | None = None
    # [P-1][k] when prompt_alt_tokens_k > 0: the draws at each prompt position 1..P-1, (token id, logprob at
    # temperature 1), in draw order.
    prompt_alt_tokens: list[list[tuple[int, float]]] | None = None
    # Why the engine gave up on this request (finish_reason "abort"): its own prefill failed, e.g. out of
    # memory; None for a request that finished, or was aborted by its caller.
    error: str | None = None


@dataclass
class Rollout:
    """One training sample: a whole (possibly multi-turn) episode as a single token stream.

    Position t of every per-token list describes token_ids[t]. Prompt and environment tokens have
    loss_mask False, logprob 0.0 and version -1.
    """

    token_ids: list[int]  # [T]
    loss_mask: list[bool]  # [T] True where the policy generated the token (trained on)
    logprobs: list[float]  # [T] behaviour log-prob of generated tokens
    versions: list[int]  # [T] policy version per generated token, -1 elsewhere
    reward: float
    group_id: str = ""
    finish_reason: FinishReason = "stop"
    metrics: dict[str, float] = field(default_factory=dict)  # env counters, e.g. format_errors

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if not len(self.loss_mask) == len(self.logprobs) == len(self.versions) == n:
            raise ValueError(
                f"Rollout per-token lists must all have length {n} (token_ids): loss_mask="
                f"{len(self.loss_mask)} logprobs={len(self.logprobs)} versions={len(self.versions)}"
            )

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    @property
    def min_version(self) -> int:
        gen = [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]
        return min(gen) if gen else -1

    @property
    def max_version(self) -> int:
        gen = [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]
        return max(gen) if gen else -1


@dataclass
class RolloutGroup:
    """The rollouts sampled for one prompt: the unit GRPO computes advantages over."""

    group_id: str
    rollouts: list[Rollout]

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rollouts]

    @property
    def is_informative(self) -> bool:
        """False when all rewards are equal: the group carries no GRPO signal."""
        return len(set(self.rewards)) > 1


@dataclass
class TrainSample:
    """A rollout after the advantage step: what the trainer consumes. The trainer never sees rewards."""

    token_ids: list[int]  # [T]
    loss_mask: list[float]  # [T] per-token weight, 0 for prompt/environment tokens
    behaviour_logprobs: list[float]  # [T] sampler log-probs (0 where masked)
    advantages: list[float]  # [T] per-token advantage (0 where masked)
    versions: list[int]  # [T] policy version per token (-1 where masked)

    @classmethod
    def from_rollout(cls, rollout: Rollout, advantage: float) -> TrainSample:
        mask = [1.0 if m else 0.0 for m in rollout.loss_mask]
        return cls(
            token_ids=list(rollout.token_ids),
            loss_mask=mask,
            behaviour_logprobs=list(rollout.logprobs),
            advantages=[advantage * m for m in mask],
            versions=list(rollout.versions),
        )


@dataclass
class AdapterUpdate:
    """One LoRA adapter's weights for the engine, tagged with its version (its optimizer steps applied).

    `tensors` uses PEFT's names (`base_model.model.<module>.lora_A.weight` [r, in], `...lora_B.weight`
    [out, r]); the adapter adds `scale * B @ A @ x` to each listed module's output.
    """

    name: str
    version: int
    rank: int
    scale: float  # alpha / rank
    tensors: dict  # PEFT name -> torch.Tensor (untyped here so types.py does not import torch)


@dataclass
class WeightUpdate:
    """A full set of policy weights tagged with the version (optimizer steps applied) that made them."""

    version: int
    state_dict: dict  # name -> torch.Tensor (kept untyped here so types.py does not import torch)
