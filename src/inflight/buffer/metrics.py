"""Pure per-step diagnostics of off-policy data: the per-token lag histogram (in optimizer steps). No state,
no I/O. (The importance-weight histogram and ESS come from the trainer: `losses.importance.off_policy_stats`.)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: stream readers and writers never pay for it
    pass

# Lag buckets [low, high] in optimizer steps: exact where bounds are usually set (0-3), then doubling, so the
# keys stay the same in every run and the tail is still visible.
LAG_BUCKETS: tuple[tuple[int, int], ...] = ((0, 0), (1, 1), (2, 2), (3, 3), (4, 7), (8, 15), (16, 1 << 62))


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
