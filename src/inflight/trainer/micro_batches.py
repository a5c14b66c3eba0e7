"""Cutting a step's rows into micro-batches by a budget of padded tokens, and into data-parallel ranks'
shares by tokens: one rule for every trainer path.

A micro-batch's cost (activations, compute) grows with rows x longest row, padding included, so that is
what the budget bounds; packed, their sum. And which sequences share a prefix (`shared_prefix_groups`),
laid out once for all of them. Knows nothing of models or losses: it sees lengths (and, for prefixes,
tokens) and returns indices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Sequence packing: indices grouped into rows of at most `capacity` tokens in total (a sequence longer
    than `capacity` goes alone), first-fit decreasing, so that a forward pass spends nothing on padding.

    Each row's sequences stay independent in the forward pass (positions restart at 0, attention stays
    inside each sequence); `Trainer` checks once that its model honours that.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    rows: list[list[int]] = []
    free: list[int] = []  # tokens left in each row
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, left in enumerate(free):
            if lengths[i] <= left:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(capacity - lengths[i])
    return rows


def group_by_total_tokens(
    lengths: Sequence[int],
    max_tokens: int | None,
    max_sequences: int | None = None,
    order: Sequence[int] | None = None,
) -> list[list[int]]:
    """Indices grouped (longest first, or in `order`) so that each group's lengths sum to at most
    `max_tokens` and it holds at most `max_sequences` (None: no bound); a sequence longer than `max_tokens`
    goes alone. The micro-batches of packed training, whose cost grows with the tokens, not with the
    longest sequence; `order` keeps neighbours together (sequences that share a prefix)."""
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if max_sequences is not None and max_sequences < 1:
        raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
    groups: list[list[int]] = []
    total = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]) if order is None else order:
        if groups:
            fits_tokens = max_tokens is None or total + lengths[i] <= max_tokens
            fits_count = max_sequences is None or len(groups[-1]) < max_sequences
            if fits_tokens and fits_count:
                groups[-1].append(i)
                total += lengths[i]
                continue
        groups.append([i])
        total = lengths[i]
    return groups


@dataclass(frozen=True)
class PrefixGroup:
    """Sequences that begin with the same `shared` tokens, laid out as that prefix once and then each
    member's own continuation (its branch). A group of one has `shared` = its length: no branch."""

    members: tuple[int, ...]
    shared: int

    def laid_out_length(self, lengths: Sequence[int]) -> int:
        return self.shared + sum(lengths[i] - self.shared for i in self.members)


def lexicographic_order(seqs: Sequence[Sequence[int]]) -> list[int]:
    """Indices of `seqs` in lexicographic order of their tokens: sequences that share a prefix adjacent,
    and the prefix every run of them shares is the least of its neighbours' common prefixes."""
    return sorted(range(len(seqs)), key=lambda i: list(seqs[i]))


def shared_prefix_groups(seqs: Sequence[Sequence[int]], max_tokens: int) -> list[PrefixGroup]:
    """Every index of `seqs` in one group, the members of a group sharing their first `shared` tokens.

    Greedy over the lexicographic order: the next sequence joins the current group when the group then
    saves more tokens (k members sharing s tokens save (k-1)s) and stays within `max_tokens` laid out;
    else it starts a group. A GRPO group's samples, which share their prompt, end up together, and
    samples of different prompts that share only a few tokens (a chat header) do not drag a group's
    prefix down to those.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    lengths = [len(s) for s in seqs]
    groups: list[PrefixGroup] = []
    for i in lexicographic_order(seqs):
        if groups:
            last = groups[-1]
            shared = min(last.shared, _common_prefix(seqs[last.members[-1]], seqs[i]))
            merged = PrefixGroup(members=(*last.members, i), shared=shared)
            saves_more = len(last.members) * shared > (len(last.members) - 1) * last.shared
            if saves_more and merged.laid_out_length(lengths) <= max_tokens:
                groups[-1] = merged
                continue
        groups.append(PrefixGroup(members=(i,), shared=lengths[i]))
    return groups


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def shard_by_tokens(lengths: Sequence[int], num_shards: int) -> list[list[int]]:
    """Indices split into `num_shards` shards of nearly equal total length: the data-parallel ranks' shares
    of a step. Longest first, each onto the shard with the fewest tokens so far (the lowest shard on a
    tie); each shard's indices in ascending order. Deterministic, so every rank computes the same split
    from the same lengths; every index lands in exactly one shard (a shard may be empty when there are
    fewer samples than shards). Greedy bound: the fullest shard exceeds the emptiest by at most the
    longest length.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    tokens = [0] * num_shards
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = min(range(num_shards), key=lambda r: (tokens[r], r))
        shards[target].append(i)
        tokens[target] += lengths[i]
    return [sorted(shard) for shard in shards]
