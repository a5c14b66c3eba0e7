"""Batched sampling with per-row temperature, top-k, top-p and seeds, and the logprob of each sampled token
in the kind each row asks for (`SamplingParams.logprobs_kind`, defined in docs/architecture.md):
- "sampled": under the distribution actually sampled from (temperature, truncation and renormalisation
  applied); greedy rows (temperature below 1e-5, `types.MIN_TEMPERATURE`: vLLM's rule) report log_softmax
  of the raw logits.
- "raw": log_softmax of the raw logits (temperature 1, untruncated), whatever the row sampled with.
Everything is float32 on the logits' device; the caller's generators must live there too.
"""

from __future__ import annotations

import math
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
    tokens, sampled = _sample(logits, params, generators, default_generator)
    raw_rows = [i for i, p in enumerate(params) if p.logprobs_kind == "raw"]
    if not raw_rows:
        return tokens, sampled
    if len(raw_rows) == len(params):
        return tokens, raw_logprobs(logits, tokens)
    index = torch.tensor(raw_rows, device=logits.device)
    return tokens, sampled.index_copy(0, index, raw_logprobs(logits[index], tokens[index]))


def topk_logprobs(logits: Tensor, params: Sequence[SamplingParams]) -> tuple[list[int], Tensor, Tensor]:
    """The most likely tokens of the rows that ask (`topk_logprobs` > 0), in each row's `logprobs_kind`.

    Returns (rows asking, ids [r, k] long, logprobs [r, k] float32) with k the largest asked; a row asking
    fewer uses its first ones. "raw" rows (and greedy ones) rank log_softmax(logits); "sampled" rows the
    distribution they draw from, where tokens outside a top-k/top-p cut are -inf.
    """
    rows = [i for i, p in enumerate(params) if p.topk_logprobs > 0]
    k = min(max((params[i].topk_logprobs for i in rows), default=0), logits.shape[-1])
    if not rows:
        empty = logits.new_empty(0, 0)
        return rows, empty.long(), empty
    index = torch.tensor(rows, device=logits.device)
    dist = logits.float()[index]
    for j, row in enumerate(rows):  # few rows ask, and each row's processing is its own
        p = params[row]
        if p.logprobs_kind == "sampled" and not p.greedy:
            scaled = dist[j : j + 1] / p.temperature
            if p.truncates_distribution:
                scaled = truncate(scaled, [p.top_k], [p.top_p])
            dist[j : j + 1] = scaled
    best, ids = torch.log_softmax(dist, dim=-1).topk(k, dim=-1)
    return rows, ids, best


def raw_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """[n] log_softmax(logits)[token] per row: temperature 1, no truncation."""
    return logits.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)


def _sample(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """Tokens and their "sampled" logprobs."""
    device = logits.device
    greedy_rows = [p.greedy for p in params]
    if all(greedy_rows):
        best, tokens = logits.max(dim=-1)
        return tokens, best - torch.logsumexp(logits, dim=-1)

    greedy = None
    temperatures = {p.temperature for p in params}
    if len(temperatures) == 1:  # the common batch: one temperature, so a scalar and no greedy rows
        (t,) = temperatures
        scaled = logits if t == 1 else logits / t  # x / 1 == x: skipping the division changes nothing
    else:
        # Greedy rows as 0, then divided by 1: their own temperature may be below float32's range (1e-300).
        temperature = torch.tensor(
            [0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32, device=device
        )
        greedy = temperature == 0
        scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    rows = [i for i, p in enumerate(params) if p.truncates_distribution]  # never greedy rows
    if rows:
        top_k = [params[i].top_k for i in rows]
        top_p = [params[i].top_p for i in rows]
        if len(rows) == len(params):
            scaled = truncate(scaled, top_k, top_p)
        else:  # out of place: `scaled` may be the caller's logits
            index = torch.tensor(rows, device=device)
            scaled = scaled.index_copy(0, index, truncate(scaled[index], top_k, top_p))
    probs = torch.softmax(scaled, dim=-1)
    # Inverse-CDF sampling: one uniform per row (n draws, not n * V as an exponential race would need).
    uniform = torch.rand(len(params), 1, generator=default_generator, dtype=torch.float64, device=device)
    for row, gen in enumerate(generators):
        if gen is not None:
            uniform[row] = torch.rand(1, generator=gen, dtype=torch.float64, device=device)
    tokens = inverse_cdf(probs, uniform)
    if greedy is not None and any(greedy_rows):  # a mixed batch with greedy rows
        # Their `scaled` rows are the raw logits, never truncated: the logprob below is the raw one.
        tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    # log of the probability (not log_softmax): one pass fewer over the vocabulary, and as exact for any
    # token that can be drawn (probabilities below float32's normal range are never sampled).
    return tokens, probs.gather(1, tokens[:, None]).squeeze(1).log()


# Above this many probabilities (rows x vocabulary) a draw searches block sums first (`_blocked_inverse_cdf`):
# the full scan's float64 copy and sequential cumsum cost ~1 ns a probability on a CPU core, several where
# the copy outgrows the caches (1 x 151,936: ~1.0 ms against 0.08), where a summing pass is vectorised. At and
# below it the blocked form's dozen small ops cost about what they save (64 x 2,048: 87 against 117 us with
# two threads, 148 against 108 with one). Measured in docs/benchmarks.md (twenty-second session).
_FULL_SCAN_MAX_ELEMENTS = 1 << 17


def inverse_cdf(probs: Tensor, uniform: Tensor) -> Tensor:
    """Per row of probs [n, V] (float32, >= 0, not necessarily normalised), the first token whose
    cumulative mass reaches (1 - u) times the row's total, for uniform u [n, 1] float64 in [0, 1): a draw
    from the row's distribution. Cumulative sums are float64, so each token's bin is as wide as its
    probability (to float32's precision) even next to a cumulative mass near 1; 1 - u lies in (0, 1], so
    the target mass is > 0 and a zero-probability token is never drawn. Returns token ids [n] (long)."""
    if probs.numel() > _FULL_SCAN_MAX_ELEMENTS:
        return _blocked_inverse_cdf(probs, uniform)
    cdf = probs.double().cumsum(dim=-1)
    target = (1.0 - uniform) * cdf[:, -1:]
    return torch.searchsorted(cdf, target).squeeze(1).clamp_max_(cdf.shape[-1] - 1)


def _blocked_inverse_cdf(probs: Tensor, uniform: Tensor) -> Tensor:
    """`inverse_cdf` in two searches: over the cumulative sums of blocks of B tokens (B ~ sqrt(V)), then
    within the block found. One pass sums every probability; the scans cover V / B block sums and B
    probabilities per row, instead of V (Qwen's 151,936-token vocabulary: ~1,200 + 128)."""
    n, vocab = probs.shape
    size = block_size(vocab)
    if vocab % size:  # zero mass at the end: never drawn (below)
        probs = torch.nn.functional.pad(probs, (0, size - vocab % size))
    blocks = probs.view(n, -1, size)
    # Each block's sum in float32 (a float64 sum would first copy every probability to float64: 72 against
    # 2 ms at 64 x 151,936 here), accumulated across blocks in float64: no bin is erased near a cumulative
    # mass of 1, as in a float32 scan over the vocabulary (6e-8 apart there).
    sums = blocks.sum(dim=-1)
    block_cdf = sums.double().cumsum_(dim=-1)  # [n, V / B]
    target = (1.0 - uniform) * block_cdf[:, -1:]
    # The first block whose cumulative mass reaches the target: the mass before it is below the target,
    # so the block's own mass, and the target's remainder within it, are > 0.
    block = torch.searchsorted(block_cdf, target).clamp_max_(block_cdf.shape[-1] - 1)  # [n, 1]
    before = block_cdf.gather(1, (block - 1).clamp_min_(0)).masked_fill_(block == 0, 0.0)
    inner = blocks.gather(1, block[:, :, None].expand(n, 1, size)).squeeze(1).double().cumsum_(dim=-1)
    # The remainder, in [0, the block's float32 sum], mapped onto the block's exact (float64) mass: each of
    # its tokens keeps a bin in proportion to its probability, the float32 sum's rounding (~1e-7 of the
    # block's mass) spread over all of them. Capped at the block's end for the last rounding: the search
    # then lands on the block's last token of nonzero probability, never on a zero one after it.
    remainder = (target - before) * (inner[:, -1:] / sums.gather(1, block).double())
    within = torch.searchsorted(inner, torch.minimum(remainder, inner[:, -1:])).clamp_max_(size - 1)
    # The clamps only act on NaN probabilities (non-finite logits), whose row the engine fails: an id in
    # range keeps the batch's gathers valid until then.
    return (block * size + within).squeeze(1).clamp_max_(vocab - 1)


def block_size(vocab: int) -> int:
    """The blocks' size for `_blocked_inverse_cdf`: the power of two at or above sqrt(vocab), halved while
    it does not divide vocab (no padding copy) down to 16; if none from there divides it, the first one."""
    first = 1 << max(4, math.ceil(math.log2(math.sqrt(vocab))))
    size = first
    while vocab % size and size > 16:
        size //= 2
    return size if vocab % size == 0 else first


def truncate(scaled: Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf (vLLM/HF order).

    scaled [n, V] temperature-scaled logits; top_k [n] (0 = off); top_p [n] (1 = off). The nucleus is
    the smallest prefix of the sorted (top-k renormalised) distribution whose mass reaches top_p. The
    per-row settings come as host lists, so no decision here waits on the device.
    """
    vocab, device = scaled.shape[-1], scaled.device
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    k = torch.tensor(ks, device=device)
    # Only a row's k best logits can survive: sort just the largest k of the batch (top-k alone is cheap).
    values, order = scaled.topk(max(ks), dim=-1)
    values = values.masked_fill(torch.arange(values.shape[-1], device=device) >= k[:, None], float("-inf"))
    if any(p < 1.0 for p in top_p):
        probs = values.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # p = 1 is "off": float rounding must not cut the tail, so compare against +inf instead.
        p = torch.tensor([q if q < 1.0 else float("inf") for q in top_p], device=device)
        beyond = mass_before >= p[:, None]
        # The top token always stays (its mass before is 0): a top_p that float32 rounds to 0 (1e-300) cut
        # every token, and the row's logits became NaN.
        beyond[:, 0] = False
        values = values.masked_fill(beyond, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter_(1, order, values)
