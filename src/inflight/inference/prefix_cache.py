"""Which cached K/V a new request can start from: the K/V of recently finished sequences, kept in spare
cache rows so that a multi-turn episode's next turn (its prompt is the last turn's prompt and completion,
then the environment's message) prefills only what is new.

Bookkeeping only: it maps token prefixes to spare rows and evicts the least recently used; the engine
copies K/V in and out of those rows (`ModelRunner.move_row`) and prefills the rest of the prompt from the
cached length. An entry holds for one adapter (by identity) at one weights version: K/V of other weights
are never reused, so a reused prefix is exactly what the current weights would compute.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class _Entry:
    tokens: tuple[int, ...]
    adapter: object | None
    version: int


class PrefixCache:
    """`rows` spare cache rows, numbered `first_row`.. (after the rows of running sequences)."""

    def __init__(self, first_row: int, rows: int) -> None:
        self.first_row, self.rows = first_row, rows
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # row -> entry, least recently used first
        # length -> (adapter's id, tokens) -> row; an entry holds its adapter, so the id stays its own
        self._by_length: dict[int, dict[tuple[int, tuple[int, ...]], int]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: Sequence[int], adapter: object | None, version: int) -> tuple[int, int] | None:
        """(row, length) of the longest cached prefix of `prompt` for this adapter and weights version,
        shorter than the prompt (its last token is always prefilled: its logits start the completion);
        None when there is none."""
        best: tuple[int, int] | None = None
        for length, rows in self._by_length.items():
            if length >= len(prompt) or (best is not None and length <= best[1]):
                continue
            row = rows.get((id(adapter), tuple(prompt[:length])))
            if row is not None and self._entries[row].version == version:
                best = (row, length)
        if best is not None:
            self._entries.move_to_end(best[0])
        return best

    def retain(self, tokens: Sequence[int], adapter: object | None, version: int) -> int | None:
        """The spare row to copy the K/V of `tokens` into (the least recently used one when all are taken),
        now recorded as holding them; None when nothing should be kept (no spare rows, or already held)."""
        if not self.rows or not tokens:
            return None
        key = (id(adapter), tuple(tokens))
        held = self._by_length.get(len(tokens), {}).get(key)
        if held is not None and self._entries[held].version == version:
            self._entries.move_to_end(held)
            return None
        if held is not None:
            self._drop(held)
        if len(self._entries) < self.rows:
            row = next(r for r in range(self.first_row, self.first_row + self.rows) if r not in self._entries)
        else:
            row = next(iter(self._entries))  # the least recently used
            self._drop(row)
        self._entries[row] = _Entry(key[1], adapter, version)
        self._by_length.setdefault(len(tokens), {})[key] = row
        return row

    def clear(self) -> None:
        """Forget every entry (new weights: nothing cached can be reused)."""
        self._entries.clear()
        self._by_length.clear()

    def _drop(self, row: int) -> None:
        entry = self._entries.pop(row)
        rows = self._by_length[len(entry.tokens)]
        del rows[(id(entry.adapter), entry.tokens)]
        if not rows:
            del self._by_length[len(entry.tokens)]
