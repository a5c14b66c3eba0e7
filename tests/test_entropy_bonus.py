"""Top-k entropy (the exploration bonus restricted to plausible tokens): value and gradient.

Reference: a naive per-row loop over the k largest logits with an explicit renormalised softmax.
"""

from __future__ import annotations

import math

import pytest
import torch

from inflight.losses import entropy_from_logits, top_k_entropy_from_logits


def naive_top_k_entropy(logits: torch.Tensor, k: int, temperature: float) -> torch.Tensor:
    out = torch.empty(logits.shape[:-1], dtype=torch.float64)
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in logits.shape[:-1]]):
        row = sorted((float(x) / temperature for x in logits[tuple(idx)]), reverse=True)[:k]
        z = sum(math.exp(x) for x in row)
        out[tuple(idx)] = -sum(math.exp(x) / z * (x - math.log(z)) for x in row)
    return out


@pytest.mark.parametrize("k,temperature", [(2, 1.0), (3, 0.7), (5, 2.0)])
def test_value_matches_naive(k: int, temperature: float) -> None:
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
    got = top_k_entropy_from_logits(logits, k, temperature)
    torch.testing.assert_close(got, naive_top_k_entropy(logits, k, temperature), rtol=1e-10, atol=1e-10)


def test_k_equal_vocab_is_full_entropy_and_two_equal_logits_give_log2() -> None:
    logits = torch.randn(4, 7, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(top_k_entropy_from_logits(logits, 7), entropy_from_logits(logits))
    tied = torch.tensor([[5.0, 5.0, -3.0, 1.0]])
    assert float(top_k_entropy_from_logits(tied, 2)) == pytest.approx(math.log(2))


def test_gradient_touches_only_the_top_k_and_passes_gradcheck() -> None:
    logits = torch.randn(
        3, 9, generator=torch.Generator().manual_seed(1), dtype=torch.float64, requires_grad=True
    )
    top_k_entropy_from_logits(logits, 2).sum().backward()
    assert logits.grad is not None
    outside = torch.ones_like(logits, dtype=torch.bool).scatter(1, logits.topk(2, dim=-1).indices, False)
    assert torch.all(logits.grad[outside] == 0)
    assert torch.any(logits.grad[~outside] != 0)
    assert torch.autograd.gradcheck(
        lambda x: top_k_entropy_from_logits(x, 3, 0.9), (logits.detach().requires_grad_(),)
    )


def test_k_below_two_is_rejected() -> None:
    with pytest.raises(ValueError, match="k >= 2"):
        top_k_entropy_from_logits(torch.zeros(1, 4), 1)


def test_exact_reverse_kl_value_gradient_and_zero_at_equality() -> None:
    """kl_ref_to_policy_exact = sum_v ref(v) (log ref(v) - log pi(v)); reference: a naive double loop."""
    from inflight.losses import kl_ref_to_policy_exact

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(2, 3, 6, generator=g, dtype=torch.float64)
    got = kl_ref_to_policy_exact(logits, ref, temperature=0.8)
    p, q = (logits.detach() / 0.8).softmax(-1), (ref / 0.8).softmax(-1)
    naive = torch.tensor(
        [
            [
                sum(float(q[i, j, v] * (q[i, j, v].log() - p[i, j, v].log())) for v in range(6))
                for j in range(3)
            ]
            for i in range(2)
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(got, naive)
    assert torch.all(got >= 0)
    torch.testing.assert_close(kl_ref_to_policy_exact(ref, ref), torch.zeros(2, 3, dtype=torch.float64))
    # d/dlogits = (pi - ref) / T: it raises every token the reference prefers, sampled or not.
    got.sum().backward()
    assert logits.grad is not None
    torch.testing.assert_close(logits.grad, (p - q) / 0.8)
