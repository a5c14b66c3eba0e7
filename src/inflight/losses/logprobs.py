"""Per-token log-probabilities and entropies from logits, in float32, chunked over rows.

Owns the logits -> per-token step; knows nothing of models, masks or losses.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

# Rows per chunk are chosen so one float32 chunk of logits holds about this many elements (64 MiB).
# Forward and backward each hold one such chunk at a time, so neither ever materialises a float32
# copy of the whole [B,T,V] logits: autograd saves only the caller's logits (and the targets); the
# backward recomputes each chunk's softmax from them.
_CHUNK_ELEMENTS = 1 << 24


def _row_chunks(num_rows: int, vocab: int) -> Iterator[slice]:
    step = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, num_rows, step):
        yield slice(start, min(start + step, num_rows))


def _compute_dtype(logits: Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)  # float32, or float64 for float64 logits


def _upcast(x: Tensor) -> Tensor:
    return x.to(_compute_dtype(x))


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    """logits / temperature in the compute dtype; no copy at temperature 1 when already float32/64 (the
    callers only read it or make new tensors from it)."""
    x = _upcast(logits)
    return x if temperature == 1.0 else x / temperature


class _TokenLogprobs(torch.autograd.Function):
    """lp = x[target] - logsumexp(x) with x = logits / temperature; d lp / d x_j = 1[j = target] - p_j."""

    @staticmethod
    def forward(ctx: Any, logits_N_V: Tensor, targets_N: Tensor, temperature: float) -> Tensor:
        num_rows, vocab = logits_N_V.shape
        logprobs_N = torch.empty(num_rows, dtype=_compute_dtype(logits_N_V), device=logits_N_V.device)
        for rows in _row_chunks(num_rows, vocab):
            # log_softmax is one fused kernel; logsumexp takes several passes and is ~2x slower here.
            logprobs_N[rows] = (
                torch.log_softmax(_scaled(logits_N_V[rows], temperature), dim=-1)
                .gather(-1, targets_N[rows, None])
                .squeeze(-1)
            )
        ctx.save_for_backward(logits_N_V, targets_N)
        ctx.temperature = temperature
        return logprobs_N

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_N: Tensor) -> tuple[Tensor, None, None]:
        logits_N_V, targets_N = ctx.saved_tensors
        chunks = list(_row_chunks(*logits_N_V.shape))
        grad_logits_N_V = None if len(chunks) == 1 else torch.empty_like(logits_N_V)
        for rows in chunks:
            g_R_1 = _upcast(grad_N[rows, None])
            # -g * p, then +g at the target: p recomputed by the fused softmax kernel (one pass, and as
            # exact as the forward's; exp(x - lse) with lse saved took two), the rest in place.
            chunk_R_V = torch.softmax(_scaled(logits_N_V[rows], ctx.temperature), dim=-1).mul_(-g_R_1)
            chunk_R_V.scatter_add_(-1, targets_N[rows, None], g_R_1)
            if ctx.temperature != 1.0:
                chunk_R_V.div_(ctx.temperature)
            if grad_logits_N_V is None:  # one chunk: it is the gradient
                return chunk_R_V.to(logits_N_V.dtype), None, None
            grad_logits_N_V[rows] = chunk_R_V
        assert grad_logits_N_V is not None  # several chunks
        return grad_logits_N_V, None, None


class _Entropy(torch.autograd.Function):
    """H = logsumexp(x) - sum_j p_j x_j with x = logits / temperature; dH/dx_j = -p_j (x_j - E_p[x])."""

    @staticmethod
    def forward(ctx: Any, logits_N_V: Tensor, temperature: float) -> Tensor:
        num_rows, vocab = logits_N_V.shape
        entropy_N = torch.empty(num_rows, dtype=_compute_dtype(logits_N_V), device=logits_N_V.device)
        lse_N = torch.empty_like(entropy_N)
        for rows in _row_chunks(num_rows, vocab):
            x_R_V = _upcast(logits_N_V[rows]) / temperature
            lse_R = torch.logsumexp(x_R_V, dim=-1)
            probs_R_V = torch.exp(x_R_V - lse_R[:, None])
            entropy_N[rows] = lse_R - (probs_R_V * x_R_V).sum(-1)
            lse_N[rows] = lse_R
        ctx.save_for_backward(logits_N_V, lse_N, entropy_N)
        ctx.temperature = temperature
        return entropy_N

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_N: Tensor) -> tuple[Tensor, None]:
        logits_N_V, lse_N, entropy_N = ctx.saved_tensors
        expected_x_N = lse_N - entropy_N  # sum_k p_k x_k
        grad_logits_N_V = torch.empty_like(logits_N_V)
        for rows in _row_chunks(*logits_N_V.shape):
            x_R_V = _upcast(logits_N_V[rows]) / ctx.temperature
            probs_R_V = torch.exp(x_R_V - lse_N[rows, None])
            chunk_R_V = x_R_V.sub_(expected_x_N[rows, None]).mul_(probs_R_V)
            grad_logits_N_V[rows] = chunk_R_V.mul_(-_upcast(grad_N[rows, None]) / ctx.temperature)
        return grad_logits_N_V, None


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probabilities [B,T] of `targets` [B,T] under softmax(logits [B,T,V] / temperature).

    Computed in float32 (float64 for float64 logits) whatever the logits' dtype. Any leading shape
    works (`logits [..., V]`, `targets [...]`). Every target must be a valid token id, padding included
    (mask it in the loss instead). The temperature must be the sampler's, so that these numbers match
    the behaviour log-probs the engine reports.
    """
    _check_temperature(temperature)
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree")
    vocab = logits.shape[-1]
    logprobs_N = _TokenLogprobs.apply(logits.reshape(-1, vocab), targets.reshape(-1).long(), temperature)
    return logprobs_N.view(targets.shape)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy [B,T] (float32, or float64; nats) of softmax(logits [B,T,V] / temperature); differentiable."""
    _check_temperature(temperature)
    vocab = logits.shape[-1]
    entropy_N = _Entropy.apply(logits.reshape(-1, vocab), temperature)
    return entropy_N.view(logits.shape[:-1])


def top_k_entropy_from_logits(logits: Tensor, k: int, temperature: float = 1.0) -> Tensor:
    """Entropy [B,T] of softmax over the k largest of logits [B,T,V] / temperature, renormalised.

    An exploration bonus on the full-vocabulary entropy also pushes probability into the long tail
    of tokens that break the answer format; restricted to the top k it spreads mass only among the
    plausible candidates (k=2 on a two-action task is the entropy of the action choice).
    """
    _check_temperature(temperature)
    if k < 2:
        raise ValueError(f"top_k_entropy_from_logits needs k >= 2, got {k}")
    top = logits.topk(min(k, logits.shape[-1]), dim=-1).values.to(_compute_dtype(logits)) / temperature
    logp = torch.log_softmax(top, dim=-1)
    return -(logp.exp() * logp).sum(-1)
