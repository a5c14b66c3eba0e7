"""The off-policy menu's names and default thresholds (`offpolicy.py` has the corrections themselves): the
run's config validates them, without torch."""

from __future__ import annotations

import math
from typing import Literal, get_args

OffPolicyKind = Literal["none", "tis_token", "tis_seq", "mis_token", "mis_seq", "icepop", "geo_mask"]
OFFPOLICY_KINDS: tuple[str, ...] = get_args(OffPolicyKind)

# (low, high) ratio thresholds per control when the config leaves them unset. Controls that use one
# threshold (a cap C) have low None; "none" uses neither.
OFFPOLICY_DEFAULTS: dict[str, tuple[float | None, float | None]] = {
    "none": (None, None),
    "tis_token": (None, 2.0),  # Yao et al. 2025 use C = 2
    "tis_seq": (None, 2.0),
    "mis_token": (None, 2.0),
    "mis_seq": (None, 2.0),
    "icepop": (0.5, 5.0),  # the IcePop write-up's [alpha, beta] (as cited; see docs/architecture.md)
    "geo_mask": (0.999, 1.001),  # verl's geometric rejection default: a per-token drift of 0.1%
}


def offpolicy_thresholds(
    kind: str, low: float | None = None, high: float | None = None
) -> tuple[float | None, float | None]:
    """The (low, high) a control runs with: the given ones, else its defaults. Raises ValueError naming the
    threshold when one is given that the control does not use, or the pair is not 0 <= low <= high, high > 0.
    """
    if kind not in OFFPOLICY_DEFAULTS:
        raise ValueError(f"unknown off-policy control {kind!r}; expected one of {OFFPOLICY_KINDS}")
    default_low, default_high = OFFPOLICY_DEFAULTS[kind]
    for name, given, default in (("ratio_low", low, default_low), ("ratio_high", high, default_high)):
        if given is not None and default is None:
            raise ValueError(f"off-policy control {kind!r} does not use {name} (got {given})")
    low = default_low if low is None else low
    high = default_high if high is None else high
    if high is not None and not high > 0:
        raise ValueError(f"off-policy control {kind!r} needs ratio_high > 0, got {high}")
    if low is not None and not 0 <= low <= (high if high is not None else math.inf):
        raise ValueError(f"off-policy control {kind!r} needs 0 <= ratio_low <= ratio_high, got {low}, {high}")
    return low, high
