"""Off-policy diagnostics between trainer and sampler: ratio statistics, effective sample size, and the
log-prob gap as a distribution. Knows nothing of which loss uses them; the corrections themselves are
`losses/offpolicy.py`.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor


def masked_mean(values: Tensor, active: Tensor) -> Tensor:
    """Mean of `values` over the `active` (bool) positions; 0 when none is active. 0-dim tensor."""
    num_active = active.sum()
    return torch.where(active, values, 0.0).sum() / num_active.clamp_min(1)


def off_policy_stats(logprobs: Tensor, behaviour_logprobs: Tensor, active: Tensor) -> dict[str, Tensor]:
    """Trainer-vs-sampler diagnostics over the `active` [B,T] tokens, as detached 0-dim tensors.

    r = exp(lp - q) is the raw per-token importance ratio (before any clipping or truncation).
    - is_weight_mean / is_weight_min / is_weight_max: statistics of r.
    - ess: effective sample size as a fraction, (sum r)^2 / (N sum r^2), in (0, 1]; 1 when on-policy.
    - logprob_diff_mean_abs / logprob_diff_max_abs: mean and max of |lp - q|, the log-prob parity gap.
    - is_hist_*: the histogram of r, as fractions of the active tokens in the buckets of
      IS_HISTOGRAM_EDGES (`is_hist_lt_0.5`, `is_hist_0.5_0.8`, ..., `is_hist_ge_2`).
    - num_tokens: N, the number of active tokens (weight for averaging these over micro-batches).
    All are 0 when no token is active.
    """
    active = active.bool()
    num_active = active.sum()
    any_active = num_active > 0
    log_ratio = torch.where(active, logprobs.detach() - behaviour_logprobs.detach(), 0.0).double()
    ratio = log_ratio.exp()  # 1 at inactive positions, which the sums below exclude
    ratio_sum = torch.where(active, ratio, 0.0).sum()
    ratio_sq_sum = torch.where(active, ratio.square(), 0.0).sum()
    ess = ratio_sum.square() / (num_active * ratio_sq_sum).clamp_min(torch.finfo(torch.float64).tiny)
    zero = torch.zeros((), dtype=torch.float64, device=logprobs.device)
    return {
        "is_weight_mean": masked_mean(ratio, active),
        "is_weight_min": torch.where(any_active, torch.where(active, ratio, torch.inf).amin(), zero),
        "is_weight_max": torch.where(any_active, torch.where(active, ratio, -torch.inf).amax(), zero),
        "ess": ess,
        "logprob_diff_mean_abs": masked_mean(log_ratio.abs(), active),
        "logprob_diff_max_abs": log_ratio.abs().amax() if log_ratio.numel() else zero,
        **_ratio_histogram(ratio, active),
        "num_tokens": num_active.double(),
    }


IS_HISTOGRAM_EDGES = (0.5, 0.8, 1.25, 2.0)


def _ratio_histogram(ratio: Tensor, active: Tensor) -> dict[str, Tensor]:
    edges = IS_HISTOGRAM_EDGES
    names = [f"is_hist_lt_{edges[0]}"]
    names += [f"is_hist_{lo}_{hi}" for lo, hi in itertools.pairwise(edges)]
    names.append(f"is_hist_ge_{edges[-1]}")
    bucket = torch.bucketize(ratio, torch.tensor(edges, dtype=ratio.dtype, device=ratio.device), right=True)
    return {name: masked_mean(bucket == i, active) for i, name in enumerate(names)}


def to_floats(stats: dict[str, Tensor]) -> dict[str, float]:
    """Detached 0-dim tensors -> python floats with one device sync."""
    if not stats:
        return {}
    values = torch.stack([value.detach().double() for value in stats.values()]).tolist()
    return dict(zip(stats, values, strict=True))


GAP_QUANTILES = (0.5, 0.9, 0.99)


def step_gap_stats(log_ratio_N: Tensor) -> dict[str, Tensor]:
    """Over all N trained tokens of a step, log_ratio_N = lp - q [N]; detached 0-dim float64 tensors.

    - ess: (sum r)^2 / (N sum r^2) with r = exp(log_ratio), exact over the step (a mean of per-micro-batch
      ESS is not the step's ESS); computed relative to the largest r, so no ratio overflows.
    - logprob_diff_p50_abs / _p90_abs / _p99_abs: quantiles of |lp - q| (linear interpolation, numpy's
      default), the sampler-trainer gap as a distribution; its max is `logprob_diff_max_abs`.
    All are 0 when N is 0.
    """
    gap = log_ratio_N.detach().double().flatten()
    zero = torch.zeros((), dtype=torch.float64, device=gap.device)
    names = [f"logprob_diff_p{round(q * 100)}_abs" for q in GAP_QUANTILES]
    if not gap.numel():
        return {"ess": zero, **dict.fromkeys(names, zero)}
    shifted = torch.exp(gap - gap.max())  # r / max(r), in (0, 1]
    ess = shifted.sum().square() / (gap.numel() * shifted.square().sum())
    # Sorting, not torch.quantile: that refuses inputs over 2^24 elements.
    ordered = gap.abs().sort().values
    out = {"ess": ess}
    for name, q in zip(names, GAP_QUANTILES, strict=True):
        position = q * (ordered.numel() - 1)
        below, above = ordered[math.floor(position)], ordered[math.ceil(position)]
        out[name] = below + (above - below) * (position - math.floor(position))
    return out
