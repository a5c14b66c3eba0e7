"""Batched sampling with per-row temperature, top-k, top-p and seeds, and the logprob of each sampled token.

The logprob is taken under the distribution actually sampled from (temperature, truncation and
renormalisation applied); greedy rows report log_softmax of the raw logits. Everything is float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from inflight.types import SamplingParams


def sample(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """Sample one token per row of logits [n, V]; returns (token ids [n] long, logprobs [n] float32).

    Rows with a generator draw their noise from it alone, so a seeded request's tokens do not depend on
    the other rows; the other rows share `default_generator`.
    """
    logits = logits.float()
    temperatures = {p.temperature for p in params}
    if temperatures == {0}:
        best, tokens = logits.max(dim=-1)
        return tokens, best - torch.logsumexp(logits, dim=-1)

    greedy = None
    if len(temperatures) == 1:  # the common batch: one temperature, so a scalar and no greedy rows
        (t,) = temperatures
        scaled = logits if t == 1 else logits / t  # x / 1 == x: skipping the division changes nothing
    else:
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        greedy = temperature == 0
        scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    rows = [i for i, p in enumerate(params) if p.truncates_distribution]  # never greedy rows
    if rows:
        top_k = torch.tensor([params[i].top_k for i in rows])
        top_p = torch.tensor([params[i].top_p for i in rows])
        if len(rows) == len(params):
            scaled = truncate(scaled, top_k, top_p)
        else:  # out of place: `scaled` may be the caller's logits
            index = torch.tensor(rows)
            scaled = scaled.index_copy(0, index, truncate(scaled[index], top_k, top_p))
    probs = torch.softmax(scaled, dim=-1)

    # Inverse-CDF sampling: one uniform per row (n draws, not n * V as an exponential race would need).
    # float64 keeps each token's bin as wide as its probability even next to a cumulative mass near 1.
    cdf = probs.double().cumsum(dim=-1)
    uniform = torch.rand(len(params), 1, generator=default_generator, dtype=torch.float64)
    for row, gen in enumerate(generators):
        if gen is not None:
            uniform[row] = torch.rand(1, generator=gen, dtype=torch.float64)
    # 1 - u lies in (0, 1]: the target mass is > 0, so a zero-probability token is never the first bin hit.
    target = (1.0 - uniform) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, target).squeeze(1).clamp_max_(cdf.shape[-1] - 1)
    if greedy is not None and 0 in temperatures:  # a mixed batch with greedy rows
        tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    # log of the probability (not log_softmax): one pass fewer over the vocabulary, and as exact for any
    # token that can be drawn (probabilities below float32's normal range are never sampled).
    return tokens, probs.gather(1, tokens[:, None]).squeeze(1).log()


def truncate(scaled: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf (vLLM/HF order).

    scaled [n, V] temperature-scaled logits; top_k [n] (0 = off); top_p [n] (1 = off). The nucleus is
    the smallest prefix of the sorted (top-k renormalised) distribution whose mass reaches top_p.
    """
    vocab = scaled.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp_max(vocab)
    # Only a row's k best logits can survive: sort just the largest k of the batch (top-k alone is cheap).
    values, order = scaled.topk(int(k.max()), dim=-1)
    values = values.masked_fill(torch.arange(values.shape[-1]) >= k[:, None], float("-inf"))
    if bool((top_p < 1.0).any()):
        probs = values.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # p = 1 is "off": float rounding must not cut the tail, so compare against +inf instead.
        p = torch.where(top_p >= 1.0, float("inf"), top_p.float())
        values = values.masked_fill(mass_before >= p[:, None], float("-inf"))  # the top token always stays
    return torch.full_like(scaled, float("-inf")).scatter_(1, order, values)
