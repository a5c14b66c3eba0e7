"""Inverse-CDF sampling (`inference/sampling.py`): the blocked search against a full float64 scan written
here, zero-probability tokens never drawn, draws in proportion to the probabilities, and the blocks' size.
Tiny settings against temperature 0 (vLLM's rule: below 1e-5 is greedy) and against the argmax."""

from __future__ import annotations

import math

import pytest
import torch

from inflight.inference.prompt_outputs import alt_tokens
from inflight.inference.sampling import _blocked_inverse_cdf, block_size, inverse_cdf, sample, topk_logprobs
from inflight.types import SamplingParams


def full_scan(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The first token whose float64 cumulative mass reaches (1 - u) x the row's total."""
    cdf = probs.double().cumsum(-1)
    reached = cdf >= (1.0 - uniform) * cdf[:, -1:]
    return reached.int().argmax(-1)  # the first True


def distributions(vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Rows of different shapes: dense, peaked, top-k truncated (zeros), one token (first, last, inside)."""
    dense = torch.softmax(torch.randn(2, vocab, generator=generator) * 3, -1)
    peaked = torch.softmax(torch.randn(1, vocab, generator=generator) * 12, -1)
    top_k = dense[:1].clone()
    top_k[top_k < top_k.topk(7).values[:, -1:]] = 0
    single = torch.zeros(3, vocab)
    single[0, 0] = single[1, vocab - 1] = single[2, vocab // 3] = 1.0
    return torch.cat([dense, peaked, top_k, single])


@pytest.mark.parametrize("vocab", [2048, 1003, 151936])
def test_blocked_search_equals_the_full_scan(vocab: int) -> None:
    """Uniforms draw what a full float64 scan draws, but u = 0 (the target is the row's whole mass): a token
    of nonzero probability at or after the scan's. The scan stops at the last token that still moves its
    float64 sum (later ones below 1e-16 of the row's mass); the blocked search compares against its
    block's mass only, and reaches tokens the scan cannot."""
    generator = torch.Generator().manual_seed(vocab)
    probs = distributions(vocab, generator)
    n = probs.shape[0]
    top = torch.full((n, 1), 1.0 - 2.0**-53, dtype=torch.float64)  # the target: 2^-53 of the mass
    for uniform in [torch.rand(n, 1, generator=generator, dtype=torch.float64) for _ in range(20)] + [top]:
        assert torch.equal(_blocked_inverse_cdf(probs, uniform), full_scan(probs, uniform))
        assert torch.equal(inverse_cdf(probs, uniform), full_scan(probs, uniform))
    zero = torch.zeros(n, 1, dtype=torch.float64)
    tokens = _blocked_inverse_cdf(probs, zero)
    assert (tokens >= full_scan(probs, zero)).all() and (probs.gather(1, tokens[:, None]) > 0).all()


@pytest.mark.parametrize("vocab", [64, 2048, 1003])
def test_zero_probability_tokens_are_never_drawn(vocab: int) -> None:
    """Only a few tokens carry mass, some at a block's edges; uniforms at both ends of [0, 1)."""
    generator = torch.Generator().manual_seed(1)
    rows = 512
    probs = torch.zeros(rows, vocab)
    for row in range(rows):
        kept = torch.randperm(vocab, generator=generator)[: 1 + row % 5]
        probs[row, kept] = torch.rand(len(kept), generator=generator) + 1e-30
    probs[0, :] = 0
    probs[0, 15] = probs[0, 16] = 0.5  # the last of a block of 16 and the first of the next
    uniform = torch.rand(rows, 1, generator=generator, dtype=torch.float64)
    uniform[::3] = 0.0
    uniform[1::3] = 1.0 - 2.0**-53
    for draw in (_blocked_inverse_cdf, inverse_cdf):
        tokens = draw(probs, uniform)
        assert (probs.gather(1, tokens[:, None]) > 0).all()


def test_draws_follow_the_probabilities() -> None:
    """40,000 draws (the blocked search: 40,000 rows of one distribution) against each token's share."""
    vocab, draws = 4096, 40_000
    probs = torch.zeros(vocab)
    probs[[3, 64, 65, 2000, 4095]] = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])
    probs[100:200] = 1e-9  # mass too small to show up, present in every block sum
    generator = torch.Generator().manual_seed(2)
    uniform = torch.rand(draws, 1, generator=generator, dtype=torch.float64)
    counts = torch.bincount(inverse_cdf(probs.expand(draws, vocab), uniform), minlength=vocab).double()
    expected = probs.double() / probs.double().sum() * draws
    heavy = probs > 0.01
    sigma = (expected[heavy] * (1 - expected[heavy] / draws)).sqrt()
    assert ((counts[heavy] - expected[heavy]).abs() < 5 * sigma).all(), (counts[heavy], expected[heavy])
    assert counts[~heavy].sum() <= 5


@pytest.mark.parametrize(
    ("vocab", "size"), [(2048, 64), (151936, 128), (128256, 256), (32000, 256), (50257, 256), (50, 16)]
)
def test_block_size_divides_the_vocabulary_where_it_can(vocab: int, size: int) -> None:
    assert block_size(vocab) == size
    assert size >= 16 and size & (size - 1) == 0  # a power of two, at least 16
    assert size <= 2 ** math.ceil(math.log2(math.sqrt(vocab))) or size == 16


def test_a_tiny_temperature_is_greedy_and_a_tiny_top_p_keeps_the_top_token() -> None:
    """temperature=1e-300 (0 in float32: infinite scaled logits) and top_p=1e-300 (0 in float32: the nucleus
    kept no token) made a row's probabilities NaN, which the engine fails as diverged weights. Alone or in a
    batch with other temperatures, a tiny temperature reports what temperature 0 reports (the raw logprob of
    the argmax), and a tiny top_p draws the argmax, whose probability after the cut is 1."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3)) * 4
    raw = torch.log_softmax(logits, -1).max().item()
    argmax = logits.argmax().item()
    rows = {  # params -> (its token, its logprob of the "sampled" kind)
        SamplingParams(temperature=0): (argmax, raw),
        SamplingParams(temperature=1e-300): (argmax, raw),
        SamplingParams(temperature=1e-6, top_p=0.5, top_k=3): (argmax, raw),
        SamplingParams(top_p=1e-300): (argmax, 0.0),
        SamplingParams(temperature=0.7, top_p=1e-300): (argmax, 0.0),
    }
    batches = [[p] for p in rows] + [list(rows), [*rows, SamplingParams()]]
    for batch in batches:
        generator = torch.Generator().manual_seed(0)
        tokens, logprobs = sample(logits.expand(len(batch), -1), batch, [None] * len(batch), generator)
        for p, token, logprob in zip(batch, tokens.tolist(), logprobs.tolist(), strict=True):
            if p in rows:
                assert (token, logprob) == pytest.approx(rows[p], abs=1e-6), (p, batch)
        assert torch.isfinite(logprobs).all()
    greedy = SamplingParams(temperature=1e-300, topk_logprobs=3)
    _, ids, best = topk_logprobs(logits, [greedy])
    assert torch.equal(ids, torch.log_softmax(logits, -1).topk(3).indices) and torch.isfinite(best).all()
    generator = torch.Generator().manual_seed(0)
    draws = alt_tokens(logits, torch.log_softmax(logits, -1), 4, 1e-300, generator)
    assert draws == alt_tokens(logits, torch.log_softmax(logits, -1), 4, 0.0, generator)
