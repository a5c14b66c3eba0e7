"""The menu of off-policy corrections between sampler and trainer: per-token weights that multiply the policy
loss, from truncated and masked importance sampling at token or sequence level. Pure functions of the
log-ratio; knows nothing of which loss uses the weights.

Why: even with identical weights the sampler's kernels and the trainer's assign different probabilities,
and in the pipeline a token may come from older weights, so samples are off-policy. Weighting a token by
pi_trainer / pi_sampler corrects that; truncating or masking large ratios bounds the variance that the
tokens the sampler under-weighted would bring.

Every control has one signature, `(log_ratio [B,T], active [B,T], low, high) -> Correction`, where
log_ratio = log pi_trainer - log pi_sampler per token and each row of [B,T] is one sequence (a whole,
possibly multi-turn, episode). Comparisons happen in log space: a sequence's summed log-ratio can be
hundreds, and exp() of it is inf.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Correction:
    """What a control did to each token; all [B,T], detached, neutral (1 / False) where not active."""

    weights: Tensor  # [B,T] float: multiplies the per-token policy loss; 0 = the token is masked out
    masked: Tensor  # [B,T] bool: active tokens dropped (weight 0) by a mask
    truncated: Tensor  # [B,T] bool: active tokens whose weight the cap lowered


def _log(threshold: float) -> float:
    return math.log(threshold) if threshold > 0 else -math.inf


def _seq_log_ratio(log_ratio: Tensor, active: Tensor) -> Tensor:
    """[B,1] log of the sequence ratio prod_t r_t over the active tokens of each row."""
    return torch.where(active, log_ratio, 0.0).sum(dim=-1, keepdim=True)


def _finish(weights: Tensor, masked: Tensor, truncated: Tensor, active: Tensor) -> Correction:
    shape = active.shape
    return Correction(
        weights=torch.where(active, weights.expand(shape), 1.0).detach(),
        masked=masked.expand(shape) & active,
        truncated=truncated.expand(shape) & active,
    )


def plain_is(log_ratio: Tensor, active: Tensor, low: float | None, high: float | None) -> Correction:
    """r_t, untruncated: the behaviour correction when only the decoupled ratio (proximal log-probs) is on."""
    none = torch.zeros_like(active)
    return _finish(log_ratio.detach().exp(), none, none, active)


def tis_token(log_ratio: Tensor, active: Tensor, low: float | None, high: float | None) -> Correction:
    """min(r_t, C): token-level truncated IS (Yao et al. 2025)."""
    cap = _require(high, "tis_token", "ratio_high (the cap C)")
    log_ratio = log_ratio.detach()
    truncated = log_ratio > _log(cap)
    return _finish(log_ratio.clamp(max=_log(cap)).exp(), torch.zeros_like(active), truncated, active)


def tis_seq(log_ratio: Tensor, active: Tensor, low: float | None, high: float | None) -> Correction:
    """min(prod_t r_t, C) on every token of the sequence: sequence-level TIS (Liu, Li et al. 2025)."""
    cap = _require(high, "tis_seq", "ratio_high (the cap C)")
    seq = _seq_log_ratio(log_ratio.detach(), active)
    truncated = seq > _log(cap)
    return _finish(seq.clamp(max=_log(cap)).exp(), torch.zeros_like(truncated), truncated, active)


def mis_token(log_ratio: Tensor, active: Tensor, low: float | None, high: float | None) -> Correction:
    """r_t where r_t <= C, else 0: token-level masked IS (Liu, Li et al. 2025)."""
    cap = _require(high, "mis_token", "ratio_high (the cap C)")
    log_ratio = log_ratio.detach()
    masked = log_ratio > _log(cap)
    # clamp before exp: a masked token's ratio may be inf, and 0 * inf is NaN
    weights = torch.where(masked, 0.0, log_ratio.clamp(max=_log(cap)).exp())
    return _finish(weights, masked, torch.zeros_like(masked), active)


def mis_seq(log_ratio: Tensor, active: Tensor, low: float | None, high: float | None) -> Correction:
    """prod_t r_t where it is <= C, else 0 for the whole sequence: sequence-level MIS (Liu, Li et al.)."""
    cap = _require(high, "mis_seq", "ratio_high (the cap C)")
    seq = _seq_log_ratio(log_ratio.detach(), active)
    masked = seq > _log(cap)
    weights = torch.where(masked, 0.0, seq.clamp(max=_log(cap)).exp())
    return _finish(weights, masked, torch.zeros_like(masked), active)


def icepop(log_ratio: Tensor, active: Tensor, low: float | None, high: float | None) -> Correction:
    """r_t where low <= r_t <= high, else 0: IcePop's two-sided token mask (Ring-1T, Ling Team 2025)."""
    low = _require(low, "icepop", "ratio_low (alpha)")
    high = _require(high, "icepop", "ratio_high (beta)")
    log_ratio = log_ratio.detach()
    masked = (log_ratio < _log(low)) | (log_ratio > _log(high))
    weights = torch.where(masked, 0.0, log_ratio.clamp(max=_log(high)).exp())
    return _finish(weights, masked, torch.zeros_like(masked), active)


def geo_mask(log_ratio: Tensor, active: Tensor, low: float | None, high: float | None) -> Correction:
    """1 where the sequence's geometric-mean ratio exp(mean_t log r_t) is in [low, high], else 0 for the
    whole sequence: geometric-mean sequence masking (Liu, Li et al. 2025; verl's Geo-RS). A rejection
    test only, so kept tokens are not re-weighted; the mean makes the test independent of length."""
    low = _require(low, "geo_mask", "ratio_low")
    high = _require(high, "geo_mask", "ratio_high")
    num_active = active.sum(dim=-1, keepdim=True).clamp_min(1)
    geo = _seq_log_ratio(log_ratio.detach(), active) / num_active
    masked = (geo < _log(low)) | (geo > _log(high))
    weights = torch.where(masked, 0.0, 1.0).to(log_ratio.dtype)
    return _finish(weights, masked, torch.zeros_like(masked), active)


def _require(value: float | None, kind: str, name: str) -> float:
    if value is None:
        raise ValueError(f"off-policy control {kind!r} needs {name}")
    return value


OffPolicyFn = Callable[[Tensor, Tensor, float | None, float | None], Correction]

OFFPOLICY_CONTROLS: dict[str, OffPolicyFn] = {
    "none": plain_is,
    "tis_token": tis_token,
    "tis_seq": tis_seq,
    "mis_token": mis_token,
    "mis_seq": mis_seq,
    "icepop": icepop,
    "geo_mask": geo_mask,
}
