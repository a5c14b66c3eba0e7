"""The trainer's and the loss's typed configs (defaults declared once, units in names)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from inflight.losses.clip_settings import CLIP_DEFAULTS, clip_thresholds
from inflight.losses.offpolicy_settings import OffPolicyKind, offpolicy_thresholds
from inflight.models.lora_targets import ATTN_TARGETS, LORA_ALPHA, MLP_TARGETS, UNEMBED_TARGETS

LossName = Literal["cross_entropy", "importance_sampling", "ppo", "cispo"]
Reduction = Literal["token_sum", "token_mean", "seq_mean", "constant"]
# NaN and infinity (`key=NaN` on the command line parses as a float) pass `<= 0` checks unnoticed and
# mean nothing for any of these knobs: refused for every float field.
_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)


class OffPolicyConfig(BaseModel):
    """The sampler-vs-trainer correction of the RL losses: one control of the menu in `losses/offpolicy.py`.

    One `kind` rather than orthogonal level x mode knobs: each control is one published estimator with its
    own thresholds, and some combinations (a truncated geometric mean) are not one. Thresholds left None
    take the control's default (`OFFPOLICY_DEFAULTS`); setting one the control does not use is an error.
    """

    model_config = _STRICT

    kind: OffPolicyKind = "none"  # none: Tinker's losses exactly, ratio against the sampler's log-probs
    ratio_low: float | None = None  # icepop, geo_mask: the lowest ratio kept
    ratio_high: float | None = None  # tis_*, mis_*: the cap C; icepop, geo_mask: the highest ratio kept

    @model_validator(mode="after")
    def _check(self) -> OffPolicyConfig:
        offpolicy_thresholds(self.kind, self.ratio_low, self.ratio_high)  # ValueError names the threshold
        return self


class LossConfig(BaseModel):
    """Which policy loss, how it is reduced, and the regularisers added to it."""

    model_config = _STRICT

    name: LossName = "ppo"  # Tinker's loss names
    reduction: Reduction = "token_mean"
    constant_normalizer: float | None = Field(default=None, gt=0)  # only for reduction=constant (Dr.GRPO)
    # Ratio thresholds (ppo, cispo); None = the loss's own default (`losses/clip_settings.py`).
    clip_low_threshold: float | None = Field(default=None, ge=0)
    clip_high_threshold: float | None = Field(default=None, ge=0)
    offpolicy: OffPolicyConfig = OffPolicyConfig()  # truncated/masked IS, IcePop, geometric masking
    entropy_coef: float = 0.0  # bonus: loss -= entropy_coef * entropy
    entropy_top_k: int = 0  # the bonus's entropy over the top-k tokens only (0 = whole vocabulary)
    kl_coef: float = 0.0  # penalty against the frozen reference model (0 = no reference model)
    # k1/k3: sampled-token estimators of KL(pi || ref); exact_ref: KL(ref || pi) over the vocabulary,
    # which keeps the reference's plausible actions alive (an exploration floor).
    kl_estimator: Literal["k1", "k3", "exact_ref"] = "k3"

    @model_validator(mode="after")
    def _check(self) -> LossConfig:
        if self.reduction == "constant" and not self.constant_normalizer:
            raise ValueError("loss.reduction=constant needs loss.constant_normalizer > 0")
        if self.entropy_top_k == 1 or self.entropy_top_k < 0:
            raise ValueError("loss.entropy_top_k must be 0 (whole vocabulary) or >= 2")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("loss.kl_coef and loss.entropy_coef must be >= 0")
        if self.name in CLIP_DEFAULTS:  # the loss's own check, before any weights load
            clip_thresholds(self.name, self.clip_low_threshold, self.clip_high_threshold)
        return self


class TrainerConfig(BaseModel):
    """Optimizer, batching, device and what trains (the full model, or one LoRA adapter when lora_rank > 0).
    A step is one optimizer update over all samples handed to `train_step`."""

    model_config = _STRICT

    lr: float = 1e-4
    # constant, or linear from lr down to lr * lr_final_frac over lr_decay_steps optimizer steps (then
    # flat). A run (`inflight run`) sets lr_decay_steps = grpo.steps when it is left at 0.
    lr_schedule: Literal["constant", "linear"] = "constant"
    lr_final_frac: float = 0.1
    lr_decay_steps: int = 0
    # AdamW's own ranges (torch refuses others only when the optimizer is built, after the weights load);
    # eps > 0: at 0, a parameter whose gradient is still 0 steps by 0 / 0.
    adam_beta1: float = Field(default=0.9, ge=0, lt=1)
    adam_beta2: float = Field(default=0.95, ge=0, lt=1)
    adam_eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    max_grad_norm: float = Field(default=1.0, ge=0)  # 0 = no clipping (below 0 it silently did not clip)
    # A micro-batch (one forward/backward; gradients accumulate across them) holds at most
    # micro_batch_size samples and, when set, micro_batch_tokens tokens (packed: the samples' tokens;
    # padded: rows x longest row; either way what bounds activation memory); a longer sample goes alone.
    # Defaults: one micro-batch for a few thousand tokens; fewer, larger operations were the faster step
    # (`make run`'s batch, 5,718 tokens: 691 ms in one micro-batch, 820 ms in two, 914 ms in four of 32
    # samples; `inflight bench train`, docs/benchmarks.md).
    micro_batch_size: int = 256
    micro_batch_tokens: int | None = 16384
    # Sequence packing: a micro-batch's samples laid end to end in rows as long as its longest sample, each
    # attending only to itself (positions restart), so no compute goes to padding. Checked once against a
    # padded forward of the model (falls back to padding, with a warning, where a model does not honour
    # it); false: right-padded rows, similar lengths together.
    packing: bool = True
    # Packed, samples that begin alike (a GRPO group's, which share their prompt) as one copy of the common
    # prefix and a branch each, under a 4D attention mask: exact, and `make run`'s batch is a quarter of
    # the tokens. Checked once against separate forwards (falls back to plain packing, with a warning).
    share_prefixes: bool = True
    # Recompute each layer's activations in the backward pass (HF's, non-reentrant): activation memory
    # of one layer instead of all, for about one more forward pass of compute.
    gradient_checkpointing: bool = False
    # The last decoder layer's MLP only at the trained positions (the only ones whose hidden states the
    # loss reads): exact; `make run`'s trainer step 0.33 -> 0.26 s. Qwen2/Qwen3/Llama/Mistral, full-
    # parameter training without gradient checkpointing; elsewhere the full layer (`trainer/last_layer.py`).
    trim_last_layer: bool = True
    device: str = "cpu"  # cpu, cuda, cuda:N, or auto (cuda when there is one)
    temperature: float = 1.0  # logprobs are computed at the sampling temperature (parity contract)
    # bfloat16 autocast on the trainer's device: True, False, or "auto" (on where the device multiplies
    # bfloat16 natively: a CUDA GPU, a CPU with AMX or AVX512-BF16). Parity tests run in float32.
    autocast_bf16: bool | Literal["auto"] = False
    # LoRA: 0 trains every parameter; N > 0 trains one rank-N adapter on the frozen model (the KL
    # reference is then the base itself, no copy), scaled by lora_alpha / lora_rank like PEFT.
    lora_rank: int = 0
    lora_alpha: float = Field(default=LORA_ALPHA, gt=0)  # > 0 even unused: a negative one means nothing
    lora_target_modules: tuple[str, ...] = ATTN_TARGETS + MLP_TARGETS  # module-name suffixes
    # the adapter's init (A ~ PEFT's kaiming-uniform, B = 0)
    lora_seed: int = Field(default=0, ge=0, lt=2**63)
    loss: LossConfig = LossConfig()

    @model_validator(mode="after")
    def _check(self) -> TrainerConfig:
        if self.lr <= 0:
            raise ValueError(f"trainer.lr must be > 0, got {self.lr}")
        if not 0 <= self.lr_final_frac <= 1:
            raise ValueError(f"trainer.lr_final_frac must be in [0, 1], got {self.lr_final_frac}")
        if self.lr_decay_steps < 0:
            raise ValueError(f"trainer.lr_decay_steps must be >= 0, got {self.lr_decay_steps}")
        if self.micro_batch_size < 1:
            raise ValueError(f"trainer.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ValueError(
                f"trainer.micro_batch_tokens must be >= 1 (or unset: no token bound), got "
                f"{self.micro_batch_tokens}"
            )
        if self.lora_rank < 0:
            raise ValueError(f"trainer.lora_rank must be >= 0 (0 = full-parameter), got {self.lora_rank}")
        known = ATTN_TARGETS + MLP_TARGETS + UNEMBED_TARGETS
        unknown = [m for m in self.lora_target_modules if m not in known]
        if self.lora_rank and (unknown or not self.lora_target_modules):
            raise ValueError(
                f"trainer.lora_target_modules must be a non-empty subset of {', '.join(known)}; "
                f"got {list(self.lora_target_modules)}"
            )
        if self.temperature <= 0:
            raise ValueError("trainer.temperature must be > 0 (greedy sampling has no logprobs to correct)")
        return self


def lr_at(config: TrainerConfig, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based: the trainer's version before the step).

    A pure function of the step, so a resumed run continues the schedule from its checkpoint's version.
    """
    if config.lr_schedule == "constant":
        return config.lr
    if config.lr_decay_steps < 1:
        raise ValueError(
            "trainer.lr_schedule=linear needs trainer.lr_decay_steps >= 1 (the steps to decay over)"
        )
    progress = min(step / config.lr_decay_steps, 1.0)
    return config.lr * (1.0 - (1.0 - config.lr_final_frac) * progress)
