"""Reductions of a masked per-token loss [B,T] to the scalar that is differentiated.

Owns the normalisation choice only (Tinker's plain sum, token or sequence means, Dr.GRPO's constant).
"""

from __future__ import annotations

from typing import Literal, get_args

from torch import Tensor

Reduction = Literal["token_sum", "token_mean", "seq_mean", "constant"]
REDUCTIONS: tuple[str, ...] = get_args(Reduction)


def _nonzero(denominator: Tensor) -> Tensor:
    # Only reached when nothing is unmasked, so the numerator is 0 too: the loss is 0, not NaN.
    return denominator.masked_fill(denominator == 0, 1.0)


def reduce_loss(
    per_token: Tensor,
    mask: Tensor,
    how: Reduction = "token_sum",
    constant_normalizer: float | None = None,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
) -> Tensor:
    """Scalar loss from `per_token` [B,T] (already multiplied by the mask) and `mask` [B,T] weights.

    - "token_sum": sum over all tokens. Tinker's semantics: no normalisation anywhere.
    - "token_mean": sum / sum(mask) over the whole batch; every token weighs the same.
    - "seq_mean": mean over sequences of (sequence sum / sequence mask sum); every sequence weighs the
      same (GRPO's original normalisation). Sequences whose mask sums to 0 are left out.
    - "constant": sum / constant_normalizer (Dr.GRPO: e.g. number of sequences x max tokens), so neither
      sequence length nor the number of unmasked tokens biases the gradient.

    With gradient accumulation over micro-batches, a local denominator makes the accumulated gradient a
    mean of means, not the mean over the global batch: pass the global count as `num_tokens`
    (token_mean: total mask sum of all micro-batches) or `num_sequences` (seq_mean: the number of
    sequences with a nonzero mask in all micro-batches).
    """
    if per_token.shape != mask.shape:
        raise ValueError(f"per_token {tuple(per_token.shape)} and mask {tuple(mask.shape)} disagree")
    if how == "token_sum":
        return per_token.sum()
    if how == "token_mean":
        if num_tokens is not None:
            return per_token.sum() / num_tokens
        return per_token.sum() / _nonzero(mask.sum())
    if how == "seq_mean":
        if per_token.ndim != 2:
            raise ValueError(f"seq_mean needs [B,T] inputs, got shape {tuple(per_token.shape)}")
        seq_mask_B = mask.sum(dim=-1)
        seq_loss_B = per_token.sum(dim=-1) / _nonzero(seq_mask_B)  # sequences with no tokens give 0
        denominator = num_sequences if num_sequences is not None else _nonzero((seq_mask_B != 0).sum())
        return seq_loss_B.sum() / denominator
    if how == "constant":
        if constant_normalizer is None or constant_normalizer <= 0:
            raise ValueError(f"how='constant' needs constant_normalizer > 0, got {constant_normalizer}")
        return per_token.sum() / constant_normalizer
    raise ValueError(f"unknown reduction {how!r}; expected one of {REDUCTIONS}")
