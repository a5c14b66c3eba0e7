"""Pure per-step diagnostics of off-policy data: the per-token lag histogram (in optimizer steps) and the
importance-weight histogram with the effective sample size. No state, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: stream readers and writers never pay for it
    from torch import Tensor

# Lag buckets [low, high] in optimizer steps: exact where bounds are usually set (0-3), then doubling, so the
# keys stay the same in every run and the tail is still visible.
LAG_BUCKETS: tuple[tuple[int, int], ...] = ((0, 0), (1, 1), (2, 2), (3, 3), (4, 7), (8, 15), (16, 1 << 62))

# Importance-weight bucket edges, symmetric in log space around 1 (1/2 <-> 2, 1/1.25 <-> 1.25, ...), so a
# drift above and below the behaviour policy shows up alike; the middle bucket is "on-policy up to 5%".
IS_EDGES: tuple[float, ...] = (0.5, 0.8, 1 / 1.05, 1.05, 1.25, 2.0)


def _lag_key(low: int, high: int) -> str:
    if low == high:
        return f"lag_steps_frac/{low}"
    return f"lag_steps_frac/{low}+" if high >= 1 << 62 else f"lag_steps_frac/{low}-{high}"


def lag_histogram(lags: Iterable[int]) -> dict[str, float]:
    """Fraction of tokens per lag bucket, plus mean/max and the token count. Lags must be >= 0."""
    counts = [0] * len(LAG_BUCKETS)
    total, lag_sum, lag_max = 0, 0, 0
    for lag in lags:
        if lag < 0:
            raise ValueError(f"negative lag {lag}: a token's version is newer than the trainer's")
        total += 1
        lag_sum += lag
        lag_max = max(lag_max, lag)
        for i, (low, high) in enumerate(LAG_BUCKETS):
            if low <= lag <= high:
                counts[i] += 1
                break
    out = {
        _lag_key(low, high): count / max(total, 1)
        for (low, high), count in zip(LAG_BUCKETS, counts, strict=True)
    }
    out.update(lag_steps_mean=lag_sum / max(total, 1), lag_steps_max=float(lag_max), lag_tokens=float(total))
    return out


def _is_key(i: int) -> str:
    low = "0" if i == 0 else f"{IS_EDGES[i - 1]:.3g}"
    high = "inf" if i == len(IS_EDGES) else f"{IS_EDGES[i]:.3g}"
    return f"is_weight_frac/{low}-{high}"


def importance_metrics(log_ratio: Tensor, mask: Tensor) -> dict[str, float]:
    """Off-policy diagnostics of per-token weights w = exp(log_ratio) over the tokens where `mask` is set.

    log_ratio: [...] log pi_trainer - log pi_behaviour per token; mask: same shape, bool or 0/1.
    - ess: (sum w)^2 / (N sum w^2), in (0, 1]; 1 when every weight is equal (on-policy). Computed from
      log-sum-exps so that large ratios cannot overflow.
    - is_weight_mean / is_weight_max / is_weight_min, and is_weight_frac/LOW-HIGH: the fraction of tokens
      with LOW <= w < HIGH.
    All zero when no token is selected.
    """
    import torch

    if log_ratio.shape != mask.shape:
        raise ValueError(f"log_ratio {tuple(log_ratio.shape)} and mask {tuple(mask.shape)} differ in shape")
    lr = log_ratio.detach().double()[mask.bool()]
    n = lr.numel()
    out = {_is_key(i): 0.0 for i in range(len(IS_EDGES) + 1)}
    if n == 0:
        return {**out, "ess": 0.0, "is_weight_mean": 0.0, "is_weight_max": 0.0, "is_weight_min": 0.0}
    log_ess = 2 * torch.logsumexp(lr, 0) - torch.logsumexp(2 * lr, 0) - math.log(n)
    buckets = torch.bucketize(lr, torch.tensor(IS_EDGES, dtype=torch.float64).log(), right=True)
    counts = torch.bincount(buckets, minlength=len(IS_EDGES) + 1).tolist()
    out.update({_is_key(i): c / n for i, c in enumerate(counts)})
    weights = lr.exp()
    out.update(
        ess=float(log_ess.exp()),
        is_weight_mean=float(weights.mean()),
        is_weight_max=float(weights.max()),
        is_weight_min=float(weights.min()),
    )
    return out
