"""What a request asks of its prompt, computed from the logits of the prefill that starts it: prompt
logprobs and their top-k, the logprobs of given target ids, and alternative draws. Pure functions of the
logits (row t predicts prompt token t + 1); the engine stores what they return on the request's sequence.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from inflight.types import MIN_TEMPERATURE


def prompt_logprobs(
    prompt: list[int], logprobs: Tensor, top_k: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """From logprobs [P-1, V] at temperature 1 (row t predicts prompt[t + 1]): ([P] log p(prompt_t |
    prompt_<t), NaN first; [P] the top_k (id, logprob) per position, most likely first, [] first)."""
    targets = torch.tensor(prompt[1:], dtype=torch.long, device=logprobs.device)[:, None]
    values = [math.nan, *logprobs.gather(1, targets).squeeze(1).tolist()]
    topk: list[list[tuple[int, float]]] = [[]]
    k = min(top_k, logprobs.shape[-1])
    if k > 0 and len(prompt) > 1:
        best, ids = logprobs.topk(k, dim=-1)
        topk += [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), best.tolist(), strict=True)]
    return values, topk


def target_logprobs(logprobs: Tensor, ids: list[list[int]]) -> list[list[float]]:
    """[P-1][K] logprobs[i, ids[i][j]] from logprobs [P-1, V]; 0.0 where the id is -1. Rows may differ in
    length."""
    width = max((len(row) for row in ids), default=0)
    if width == 0:
        return [[] for _ in ids]
    padded = torch.tensor([row + [-1] * (width - len(row)) for row in ids], device=logprobs.device)
    values = logprobs.gather(1, padded.clamp_min(0)).masked_fill(padded < 0, 0.0).tolist()
    return [row_values[: len(row)] for row, row_values in zip(ids, values, strict=True)]


def alt_tokens(
    logits: Tensor, logprobs: Tensor, k: int, temperature: float, generator: torch.Generator
) -> list[list[tuple[int, float]]]:
    """k draws with replacement from softmax(logits / temperature) per row of logits [P-1, V] (the argmax
    below MIN_TEMPERATURE, greedy), each with its logprob from logprobs [P-1, V] (temperature 1)."""
    if logits.shape[0] == 0:
        return []
    if temperature < MIN_TEMPERATURE:
        ids = logits.argmax(dim=-1, keepdim=True).expand(-1, k)
    else:
        probs = torch.softmax(logits / temperature, dim=-1)
        ids = torch.multinomial(probs, k, replacement=True, generator=generator)
    values = logprobs.gather(1, ids)
    return [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
