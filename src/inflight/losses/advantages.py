"""Group-relative advantages: the rewards of one prompt's group of rollouts become per-rollout advantages.

Owns only the rewards -> advantages step; the trainer never sees rewards, and per-token broadcasting
(every token of a rollout gets its rollout's advantage) belongs to the caller.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

AdvantageMethod = Literal["mean", "mean_std", "leave_one_out", "dr_grpo"]
ADVANTAGE_METHODS: tuple[str, ...] = get_args(AdvantageMethod)


def _advantages_last_dim(rewards_N_G: Tensor, method: str, eps: float) -> Tensor:
    """The formulas, over the last dimension (the group)."""
    rewards_N_G = rewards_N_G.float()
    group_size = rewards_N_G.shape[-1]
    centered_N_G = rewards_N_G - rewards_N_G.mean(dim=-1, keepdim=True)
    if method in ("mean", "dr_grpo"):
        return centered_N_G
    if method == "mean_std":
        if group_size < 2:  # the sample std of one reward is undefined; it carries no signal either
            return torch.zeros_like(centered_N_G)
        std_N_1 = rewards_N_G.std(dim=-1, keepdim=True)  # Bessel-corrected, as TRL and verl compute it
        # A group whose rewards are (nearly) all equal carries no GRPO signal: its advantages are 0, never
        # NaN, and never float noise blown up by a tiny std.
        return torch.where(std_N_1 > eps, centered_N_G / std_N_1.clamp_min(eps), 0.0)
    if method == "leave_one_out":
        if group_size < 2:
            raise ValueError("leave_one_out needs a group of at least 2 rollouts (no others to average)")
        # r_i - (sum_j r_j - r_i) / (G - 1)  ==  G / (G - 1) * (r_i - mean)
        return centered_N_G * (group_size / (group_size - 1))
    raise ValueError(f"unknown advantage method {method!r}; expected one of {ADVANTAGE_METHODS}")


def group_advantages(rewards_G: Tensor, method: AdvantageMethod = "mean", eps: float = 1e-6) -> Tensor:
    """Advantages [G] (float32) of one group's rewards [G], the rollouts of one prompt.

    - "mean": A_i = r_i - mean(r). The Tinker cookbook's default (tinker_cookbook/rl/data_processing.py).
    - "mean_std": A_i = (r_i - mean(r)) / std(r), GRPO as in DeepSeekMath (Shao et al. 2024,
      arXiv:2402.03300). std is the sample (Bessel-corrected) std of the group; groups with std <= eps
      (all rewards equal) get zero advantages instead of NaN.
    - "leave_one_out": A_i = r_i - mean_{j != i}(r_j), the RLOO baseline (Kool et al. 2019, "Buy 4
      REINFORCE samples, get a baseline for free!"; Ahmadian et al. 2024, arXiv:2402.14740). Unbiased,
      since the baseline does not depend on the sample it corrects. Needs G >= 2.
    - "dr_grpo": A_i = r_i - mean(r), Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A
      Critical Perspective", arXiv:2503.20783), which drops GRPO's std normalisation. Its other change
      is in the token reduction, not here: sum over tokens divided by a constant (e.g. batch size x max
      tokens) instead of by each sequence's length; use `reduce_loss(..., how="constant")`.
    """
    if rewards_G.ndim != 1:
        raise ValueError(f"rewards_G must be 1-D [G], got shape {tuple(rewards_G.shape)}")
    return _advantages_last_dim(rewards_G, method, eps)


def batch_group_advantages(
    rewards_N_G: Tensor, method: AdvantageMethod = "mean", eps: float = 1e-6
) -> Tensor:
    """Advantages [N,G] (float32) of N groups of G rewards each, group by group; see `group_advantages`."""
    if rewards_N_G.ndim != 2:
        raise ValueError(f"rewards_N_G must be 2-D [N,G], got shape {tuple(rewards_N_G.shape)}")
    return _advantages_last_dim(rewards_N_G, method, eps)
