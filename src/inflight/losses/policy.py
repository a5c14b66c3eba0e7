"""Per-token policy losses under Tinker's names, one signature: `fn(LossInputs, LossParams) -> LossOutputs`.

Pure tensors in and out; knows nothing of models, micro-batches or how the per-token loss is reduced.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from inflight.losses.clip_settings import clip_thresholds
from inflight.losses.importance import masked_mean, off_policy_stats, to_floats
from inflight.losses.kl import kl_k3
from inflight.losses.offpolicy import OFFPOLICY_CONTROLS
from inflight.losses.offpolicy_settings import OffPolicyKind, offpolicy_thresholds

# DRO's quadratic-penalty coefficient when `loss_fn_config` has no "beta". Tinker's DRO page shows only a
# custom value (0.05); 0.01 is the default of the published reference `dro_loss(loss_fn_inputs, config)`.
DRO_DEFAULT_BETA = 0.01
# stable_reinforce's KL coefficient when `loss_fn_config` has no "kl_coeff". Tinker publishes no default;
# 0.01 gives the pull toward the sampler dro's default strength near q (both gradients are
# coefficient * (lp - q) to first order), so switching between the two losses needs no retuning.
STABLE_REINFORCE_DEFAULT_KL_COEFF = 0.01


@dataclass(frozen=True)
class LossInputs:
    """Per-token tensors, all [B,T] and aligned to target positions."""

    logprobs: Tensor  # [B,T] trainer log-probs lp of the target tokens; carries grad
    mask: Tensor  # [B,T] float per-token weights w (Tinker's `weights`); 0 = ignore the token
    behaviour_logprobs: Tensor | None = None  # [B,T] sampler log-probs q (Tinker's `logprobs` input)
    advantages: Tensor | None = None  # [B,T] advantage A of each token (its rollout's, usually)
    # [B,T] trainer log-probs under the weights that generated the samples (no grad), when the trainer
    # still has them; makes the off-policy correction decoupled (see `_anchor_logprobs`). Not a Tinker input.
    proximal_logprobs: Tensor | None = None


@dataclass(frozen=True)
class LossParams:
    """Tinker's `loss_fn_config` plus the off-policy correction; None means the default."""

    clip_low_threshold: float | None = None  # ratio threshold (not epsilon): ppo 0.8, cispo 0.0
    clip_high_threshold: float | None = None  # ratio threshold: ppo 1.2, cispo 4.0
    beta: float | None = None  # dro's penalty coefficient on (lp - q)^2; None = DRO_DEFAULT_BETA
    kl_coeff: float | None = None  # stable_reinforce's KL(sampler || learner) weight; None = its default
    # Sampler-vs-trainer correction of the RL losses (`losses/offpolicy.py`); see `_anchor_logprobs`.
    # "none" keeps Tinker's losses exactly. Thresholds: None = the control's default.
    offpolicy: OffPolicyKind = "none"
    offpolicy_ratio_low: float | None = None
    offpolicy_ratio_high: float | None = None

    def clip_thresholds(self, loss_name: str) -> tuple[float, float]:
        return clip_thresholds(loss_name, self.clip_low_threshold, self.clip_high_threshold)


@dataclass(frozen=True)
class LossOutputs:
    per_token: Tensor  # [B,T] loss per token, already multiplied by the mask; reduce it to a scalar
    # Detached python floats over the unmasked tokens: `off_policy_stats`, clip fractions (ppo, cispo), and
    # the off-policy correction's offpolicy_masked_frac / offpolicy_truncated_frac (RL losses).
    metrics: dict[str, float] = field(default_factory=dict)


LossFn = Callable[[LossInputs, LossParams], LossOutputs]


def _check_shapes(inputs: LossInputs) -> None:
    for name in ("mask", "behaviour_logprobs", "advantages", "proximal_logprobs"):
        value = getattr(inputs, name)
        if value is not None and value.shape != inputs.logprobs.shape:
            raise ValueError(f"{name} {tuple(value.shape)} != logprobs {tuple(inputs.logprobs.shape)}")


@dataclass(frozen=True)
class _PolicyTerms:
    """What every RL loss needs. Masked positions are neutralised (ratio 1, advantage 0, weight 1) so
    that whatever they hold (padding, inf, NaN) cannot leak into values or gradients through 0 * inf."""

    ratio: Tensor  # [B,T] policy ratio r = exp(lp - anchor); carries grad
    log_ratio: Tensor  # [B,T] lp - anchor; carries grad
    anchor: Tensor  # [B,T] detached log-probs the ratio is taken against: q, unless a correction is on
    advantages: Tensor  # [B,T]
    correction: Tensor | None  # [B,T] detached off-policy weights, or None when the loss is Tinker's exactly
    active: Tensor  # [B,T] bool, mask != 0
    stats: dict[str, Tensor]  # 0-dim detached tensors, turned into metrics once at the end


def _require(value: Tensor | None, name: str, loss_name: str) -> Tensor:
    if value is None:
        raise ValueError(f"loss {loss_name!r} needs `{name}` (got None)")
    return value


def _anchor_logprobs(inputs: LossInputs) -> Tensor:
    """The log-probs the policy ratio is taken against when an off-policy correction is on (Tinker's: q).

    Tinker's losses use r = exp(lp - q). The corrections (truncated IS, Yao et al. 2025, and the rest of
    `losses/offpolicy.py`) split it instead: loss(r = exp(lp - anchor)) * w(anchor - q), where w is the
    control's detached weight (min(exp(anchor - q), C) for token TIS) and anchor is the trainer's log-probs
    under the sampling weights (`proximal_logprobs`; with them this is decoupled PPO, Hilton et al. 2021,
    arXiv:2110.00641). If the trainer no longer has those weights, anchor = stopgrad(lp): r is 1 in value
    with gradient grad(lp), so importance_sampling becomes the corrected policy gradient
    -w(lp - q) A grad(lp), and ppo's clip is inactive (one optimizer step per batch).
    Multiplying Tinker's r = exp(lp - q) by the weight instead would correct the mismatch twice.
    """
    if inputs.proximal_logprobs is not None:
        return inputs.proximal_logprobs.detach()
    return inputs.logprobs.detach()


def _policy_terms(inputs: LossInputs, params: LossParams, loss_name: str) -> _PolicyTerms:
    behaviour = _require(inputs.behaviour_logprobs, "behaviour_logprobs", loss_name)
    advantages = _require(inputs.advantages, "advantages", loss_name)
    _check_shapes(inputs)
    lp = inputs.logprobs
    active = inputs.mask != 0
    # Inactive positions: q := anchor := lp (ratio 1), A := 0.
    behaviour = torch.where(active, behaviour.detach(), lp.detach())
    stats = off_policy_stats(lp, behaviour, active)
    anchor, weights = behaviour, None
    zero = torch.zeros((), dtype=torch.float64, device=lp.device)
    masked_frac, truncated_frac = zero, zero
    # With proximal log-probs alone ("none"), the behaviour correction is the plain, untruncated ratio.
    if inputs.proximal_logprobs is not None or params.offpolicy != "none":
        anchor = torch.where(active, _anchor_logprobs(inputs), lp.detach())
        low, high = offpolicy_thresholds(
            params.offpolicy, params.offpolicy_ratio_low, params.offpolicy_ratio_high
        )
        correction = OFFPOLICY_CONTROLS[params.offpolicy](anchor - behaviour, active, low, high)
        weights = correction.weights
        masked_frac = masked_mean(correction.masked, active)
        truncated_frac = masked_mean(correction.truncated, active)
    stats["offpolicy_masked_frac"] = masked_frac
    stats["offpolicy_truncated_frac"] = truncated_frac
    log_ratio = lp - anchor
    return _PolicyTerms(
        ratio=torch.exp(log_ratio),
        log_ratio=log_ratio,
        anchor=anchor,
        advantages=torch.where(active, advantages, 0.0),
        correction=weights,
        active=active,
        stats=stats,
    )


def _finish(per_token: Tensor, inputs: LossInputs, terms: _PolicyTerms) -> LossOutputs:
    if terms.correction is not None:
        per_token = per_token * terms.correction
    return LossOutputs(per_token=per_token * inputs.mask, metrics=to_floats(terms.stats))


def _clip_stats(clipped_low: Tensor, clipped_high: Tensor, active: Tensor) -> dict[str, Tensor]:
    return {
        "clip_fraction": masked_mean(clipped_low | clipped_high, active),
        "clip_low_fraction": masked_mean(clipped_low, active),
        "clip_high_fraction": masked_mean(clipped_high, active),
    }


def cross_entropy(inputs: LossInputs, params: LossParams) -> LossOutputs:
    """-w * lp. Weights may be any float (Tinker's forward_backward_custom sends -dC/dlp)."""
    _check_shapes(inputs)
    num_tokens = (inputs.mask != 0).sum().double()
    return LossOutputs(
        per_token=-inputs.mask * inputs.logprobs, metrics=to_floats({"num_tokens": num_tokens})
    )


def importance_sampling(inputs: LossInputs, params: LossParams) -> LossOutputs:
    """-r * A (REINFORCE with importance weights); gradient -r * A * w * grad(lp). No clipping."""
    terms = _policy_terms(inputs, params, "importance_sampling")
    return _finish(-terms.ratio * terms.advantages, inputs, terms)


def ppo(inputs: LossInputs, params: LossParams) -> LossOutputs:
    """-min(r * A, clip(r, low, high) * A) (Schulman et al. 2017, arXiv:1707.06347)."""
    low, high = params.clip_thresholds("ppo")
    terms = _policy_terms(inputs, params, "ppo")
    ratio, advantages = terms.ratio, terms.advantages
    per_token = -torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    # A token is clipped when the min picks the clipped branch and its gradient is zero: the ratio left
    # [low, high] in the direction its advantage pushes (below low with A < 0, above high with A > 0).
    # Leaving it the other way keeps the unclipped, pessimistic branch and its gradient: not clipped.
    ratio = ratio.detach()
    clipped_low = terms.active & (advantages < 0) & (ratio < low)
    clipped_high = terms.active & (advantages > 0) & (ratio > high)
    terms.stats.update(_clip_stats(clipped_low, clipped_high, terms.active))
    return _finish(per_token, inputs, terms)


def cispo(inputs: LossInputs, params: LossParams) -> LossOutputs:
    """-stopgrad(clip(r, low, high)) * lp * A (MiniMax-M1, arXiv:2506.13585); clips the IS weight, never
    drops a token's gradient."""
    low, high = params.clip_thresholds("cispo")
    terms = _policy_terms(inputs, params, "cispo")
    ratio = terms.ratio.detach()
    per_token = -ratio.clamp(low, high) * inputs.logprobs * terms.advantages
    # A token is clipped when the clip changed its gradient weight: r outside [low, high] and A != 0
    # (with A == 0 the term is 0 whatever the weight).
    nonzero_advantage = terms.active & (terms.advantages != 0)
    clipped_low = nonzero_advantage & (ratio < low)
    clipped_high = nonzero_advantage & (ratio > high)
    terms.stats.update(_clip_stats(clipped_low, clipped_high, terms.active))
    return _finish(per_token, inputs, terms)


def dro(inputs: LossInputs, params: LossParams) -> LossOutputs:
    """-(lp * A - beta/2 * (lp - q)^2) (Richemond et al. 2024, arXiv:2405.19107; Tinker's `dro` page).

    Offline-capable: no ratio, a quadratic pull of lp towards the sampler's q instead of clipping. Unlike
    the other RL losses it is not zero where A = 0: the penalty acts on every unmasked token.
    """
    beta = DRO_DEFAULT_BETA if params.beta is None else params.beta
    if not (math.isfinite(beta) and beta >= 0):
        raise ValueError(f"dro needs a finite beta >= 0, got {beta}")
    terms = _policy_terms(inputs, params, "dro")
    per_token = -(inputs.logprobs * terms.advantages - 0.5 * beta * terms.log_ratio.square())
    return _finish(per_token, inputs, terms)


def stable_reinforce(inputs: LossInputs, params: LossParams) -> LossOutputs:
    """-lp * A + kl_coeff * (r - 1 - log r), r = exp(lp - q): REINFORCE plus KL(sampler || learner).

    Tinker's objective is unpublished; this is a reading of what is public, not its formula. Tinker's
    StableReinforce page (tinker-docs.thinkingmachines.ai/tinker/losses/stable-reinforce, alpha) calls it
    "a REINFORCE variant that stays stable even when the sampling policy differs from the policy being
    trained" (async RL, different numerics), computed from information the sampler records
    (`record_stability_info`) and found through the datums' provenance; the `tinker` 0.38.0 SDK names its
    config key, `kl_coeff` (`ForwardBackwardInput.loss_fn_config`), with no default; tinker-cookbook 0.6.1
    (`rl/train.py`) says it "only accepts nonzero advantages on sampled tokens". Read as: the REINFORCE
    surrogate -A * lp, whose gradient no importance ratio multiplies (bounded however stale the sample),
    plus kl_coeff times k3 of KL(sampler || learner) on the sampler's tokens: r - 1 - log r (Schulman 2020,
    `kl_k3` with the sampler as the policy) is >= 0, and both its value and its gradient, (r - 1) grad(lp),
    are unbiased for KL(q || p) and its gradient, so it pulls the learner back toward the sampler. On policy
    (r = 1) the gradient is importance_sampling's, -A grad(lp). Unlike the ratio losses it is not zero where
    A = 0: the penalty acts on every unmasked token (the service keeps only sampled tokens in the mask).
    """
    kl_coeff = STABLE_REINFORCE_DEFAULT_KL_COEFF if params.kl_coeff is None else params.kl_coeff
    if not (math.isfinite(kl_coeff) and kl_coeff >= 0):
        raise ValueError(f"stable_reinforce needs a finite kl_coeff >= 0, got {kl_coeff}")
    terms = _policy_terms(inputs, params, "stable_reinforce")
    kl = kl_k3(terms.anchor, inputs.logprobs)  # r - 1 - log r
    terms.stats["kl_sampler_k3"] = masked_mean(kl.detach().double(), terms.active)
    per_token = -inputs.logprobs * terms.advantages + kl_coeff * kl
    return _finish(per_token, inputs, terms)


LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "stable_reinforce": stable_reinforce,
}
