"""Per-token estimators of KL(pi || ref) from sampled tokens' log-probs (Schulman, "Approximating KL
divergence", 2020). Owns the formulas only; which estimator, its coefficient and its reduction are the
caller's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

KLEstimator = Callable[[Tensor, Tensor], Tensor]


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = lp - lp_ref [B,T]: unbiased for KL(pi || ref) under tokens sampled from pi; high variance and
    can be negative. Differentiated as a loss its gradient has expectation zero (E_pi[grad lp] = 0)."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = (lp - lp_ref)^2 / 2 [B,T]: biased but low variance, >= 0. Differentiated as a loss on tokens
    sampled from pi, its gradient is unbiased for grad KL(pi || ref)."""
    return 0.5 * (logprobs - ref_logprobs).square()


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = exp(lp_ref - lp) - (lp_ref - lp) - 1 [B,T]: unbiased for KL(pi || ref) under tokens sampled
    from pi, low variance, and >= 0 (e^x >= 1 + x). Differentiated as a loss, its expected gradient is
    that of the reverse KL(ref || pi), not KL(pi || ref) (the GRPO practice)."""
    log_ratio = ref_logprobs - logprobs
    return log_ratio.expm1() - log_ratio  # expm1 keeps precision near lp == lp_ref


KL_ESTIMATORS: dict[str, KLEstimator] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_ref_to_policy_exact(logits: Tensor, ref_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Exact KL(ref || pi) [.., ] over the whole vocabulary from logits [.., V] (no sampling).

    Mass-covering: its gradient, -sum_v ref(v) grad log pi(v), reaches tokens the policy no longer
    samples, so a penalty on it keeps every action the reference finds plausible from vanishing
    (exploration), while tokens the reference never produces gain nothing. The sampled estimators
    above cannot restore an action that is never sampled.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)  # float32, or float64 for float64 logits
    logp = (logits.to(dtype) / temperature).log_softmax(-1)
    ref_logp = (ref_logits.to(dtype) / temperature).log_softmax(-1)
    return (ref_logp.exp() * (ref_logp - logp)).sum(-1)
