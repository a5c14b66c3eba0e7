"""The clipped losses' ratio thresholds (ppo, cispo): their defaults and their one check, without torch, so
that the run's config refuses bad ones before any weights load and the loss (`policy.py`) applies the same
rule."""

from __future__ import annotations

# Per-loss defaults of Tinker's `loss_fn_config` ratio thresholds (reference/tinker-api.md §7.3).
CLIP_DEFAULTS: dict[str, tuple[float, float]] = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0)}


def clip_thresholds(loss_name: str, low: float | None, high: float | None) -> tuple[float, float]:
    """(low, high) for `loss_name`, each the loss's default where None; ValueError unless 0 <= low <= high
    (the message names the defaults, which an unset threshold took)."""
    default_low, default_high = CLIP_DEFAULTS[loss_name]
    low = default_low if low is None else low
    high = default_high if high is None else high
    if not 0.0 <= low <= high:
        raise ValueError(
            f"{loss_name} needs 0 <= clip_low_threshold <= clip_high_threshold, got {low} and {high} "
            f"(its defaults, used when unset: {default_low} and {default_high})"
        )
    return low, high
