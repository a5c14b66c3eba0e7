"""Cutting a step's rows into micro-batches by a budget of padded tokens: one rule for every trainer path.

A micro-batch's cost (activations, compute) grows with rows x longest row, padding included, so that is
what the budget bounds. Knows nothing of models or losses: it sees lengths and returns row indices.
"""

from __future__ import annotations

from collections.abc import Sequence


def pack_by_tokens(
    lengths: Sequence[int], max_tokens: int | None, max_rows: int | None = None
) -> list[list[int]]:
    """Row indices grouped so that rows x longest length <= `max_tokens` and rows <= `max_rows` (None: no
    bound); a row longer than `max_tokens` goes alone.

    Longest first, so similar lengths share a micro-batch and little compute goes to padding. Every trainer
    reduces with the whole step's denominators, so the grouping changes only rounding, never the result.
    """
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches:
            last = batches[-1]
            fits_tokens = max_tokens is None or (len(last) + 1) * lengths[last[0]] <= max_tokens
            fits_rows = max_rows is None or len(last) < max_rows
            if fits_tokens and fits_rows:
                last.append(i)
                continue
        batches.append([i])
    return batches
