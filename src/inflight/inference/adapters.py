"""The engine's LoRA adapters: an `AdapterUpdate` checked against the modules a runner can adapt, and the
masked-dense form in which rows of different adapters share one forward (the fast runner's LoRA).

Knows nothing of requests, versions or which row uses which adapter: the engine decides that, a runner
applies it. Validation runs in the caller's thread of `set_adapter`, so a bad update fails there, at once.

Why masked-dense. The active adapters (those some row of the forward uses) are zero-padded to a common rank
R and concatenated: A [S*R, in], B^T [S*R, out]. A forward computes h = x A^T for every slot, zeroes the
slots a row does not use (h.view(n, S, R) * one-hot), and accumulates h B^T into the base output in place:
two dense matmuls per site, no per-row weight copies, exact (the padded ranks and the masked slots add exact
zeros). Measured on this machine (Intel Xeon, 2 cores), one site, 8 adapters x 8 rows, rank 8, microseconds
over the base matmul, 1 thread: in 128 -> out 256: masked-dense 45, gathered bmm (A[slot], B[slot] per row)
181, grouped (index_select + 2 matmuls + index_add per adapter) 157; 128 -> 1024 at rank 16: 159 / 792 /
218; 512 prefill tokens 128 -> 1024: 685 / 3489 / 488 (2 threads: 380 / 1961 / 566). Its cost grows with S,
but it still led at 32 adapters x 2 rows (128 vs 191 gathered, 576 grouped) and tied gathered at 64 x 1.
Hence masked-dense for any mix of rows, and only the batch's adapters in the stack. When the rows come as
one equal run per adapter in slot order (requests submitted per adapter, e.g. a group or a Tinker sample of
n), the chunked form skips the mask and the other slots' FLOPs: x viewed as [S, rows/S, in], two bmm
(one adapter: mm/addmm). 8 x 8 rows, same sites, 1 thread: 25 vs 97 (qkv, rank 24 after fusing), 40 vs 243
(gate/up), 25 vs 74 (down); it lifted `inflight bench engine`'s ratio_multi_lora_batched from ~2.7 to ~3.1.
Where the runner computes an output as its two column halves (gate/up, one matmul per thread), the LoRA
accumulates into the halves with B^T split alike (`add_halves_`) rather than forcing one [rows, out]
matmul, which MKL spreads over two threads less well: on the EPYC Zen 4, 64 rows of gate/up with 8
adapters took 150 us against 261.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from inflight.types import AdapterUpdate

# module name -> (in_features, out_features): the linear layers a runner can adapt
ModuleShapes = Mapping[str, tuple[int, int]]
# module name -> (A [r, in], B [out, r]), float32
AdapterModules = dict[str, tuple[Tensor, Tensor]]

_PEFT_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")


def parse_adapter(update: AdapterUpdate, shapes: ModuleShapes) -> AdapterModules:
    """The update's A/B per module (detached float32 copies); ValueError naming what is wrong and the fix."""
    name = update.name
    if not isinstance(name, str) or not name:
        raise ValueError(f"AdapterUpdate: name must be a non-empty string, got {name!r}")
    if update.rank < 1:
        raise ValueError(f"adapter {name!r}: rank must be >= 1, got {update.rank}")
    if not math.isfinite(update.scale):
        raise ValueError(f"adapter {name!r}: scale must be finite, got {update.scale}")
    if not update.tensors:
        raise ValueError(f"adapter {name!r}: no tensors")
    if not shapes:
        raise ValueError(
            f"adapter {name!r}: this engine's model has no linear layers a LoRA adapter can target"
        )
    parts: dict[str, dict[str, Tensor]] = {}
    for key, tensor in update.tensors.items():
        match = _PEFT_KEY.match(key)
        if match is None:
            raise ValueError(
                f"adapter {name!r}: tensor name {key!r} is not PEFT's "
                "'base_model.model.<module>.lora_A.weight' / '...lora_B.weight'"
            )
        parts.setdefault(match["module"], {})[match["which"]] = tensor
    unknown = sorted(set(parts) - set(shapes))
    if unknown:
        known = sorted({m.rsplit(".", 1)[-1] for m in shapes})
        raise ValueError(
            f"adapter {name!r}: module {unknown[0]!r} is not a LoRA target of this model "
            f"(targets are its {', '.join(known)} layers, e.g. {min(shapes)!r})"
        )
    modules: AdapterModules = {}
    for module, ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(
                f"adapter {name!r}: module {module!r} needs both lora_A and lora_B, got {sorted(ab)}"
            )
        fan_in, fan_out = shapes[module]
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (update.rank, fan_in) or tuple(b.shape) != (fan_out, update.rank):
            raise ValueError(
                f"adapter {name!r}: module {module!r} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}; expected ({update.rank}, {fan_in}) and ({fan_out}, {update.rank}) "
                f"for rank {update.rank}"
            )
        a, b = (t.detach().to("cpu", torch.float32, copy=True) for t in (a, b))
        # Refused, not served: in the masked-dense form every row multiplies each slot's B (its own
        # adapter's by 1, the others' by 0), and 0 x NaN is NaN, so one such adapter would poison the
        # rows of every adapter in its forwards.
        for which, t in (("lora_A", a), ("lora_B", b)):
            if not torch.isfinite(t).all():
                raise ValueError(
                    f"adapter {name!r}: module {module!r}'s {which} holds NaN or infinite values (its "
                    "training diverged): register an earlier checkpoint, and train with a lower learning rate"
                )
        modules[module] = (a, b)
    return modules


# A fused site of a runner (one matmul) -> its parts: (module, first output column, output width).
SiteParts = Sequence[tuple[str, int, int]]


@dataclass(eq=False)  # identity: stacks are cached per tuple of adapter objects
class FusedAdapter:
    """One adapter laid out over a runner's fused matmuls: per site, A [r, in] (the parts' A stacked) and
    scale-folded B^T [r, out] (block-diagonal over the parts: part j's rows write only its columns)."""

    sites: dict[str, tuple[Tensor, Tensor]]

    @classmethod
    def build(
        cls,
        modules: AdapterModules,
        scale: float,
        layout: Mapping[str, SiteParts],
        dtype: torch.dtype,
        device: torch.device,
    ) -> FusedAdapter:
        sites = {}
        for site, parts in layout.items():
            present = [(m, start, width) for m, start, width in parts if m in modules]
            if not present:
                continue
            out_width = sum(width for _, _, width in parts)
            a = torch.cat([modules[m][0] for m, _, _ in present])
            b_t = torch.zeros(a.shape[0], out_width)
            row = 0
            for m, start, width in present:
                b = modules[m][1]
                b_t[row : row + b.shape[1], start : start + width] = (scale * b).t()
                row += b.shape[1]
            sites[site] = (a.to(device, dtype), b_t.to(device, dtype))
        return cls(sites)


# At most this rank, the chunked form's A side multiplies by A [S, R, in] read transposed rather than by a
# contiguous [S, in, R]: MKL's narrow-output batched matmul is faster that way. Measured on the EPYC Zen 4
# (2 threads, 8 slots x 8 rows, microseconds): in 512, R 8: 14 against 25; in 896: 22 against 39; in 4864:
# 89 against 194; at R 16 the two tie, at R 32 the contiguous layout leads by ~10%.
_TRANSPOSED_A_MAX_RANK = 8


@dataclass(frozen=True)
class _Stack:
    """The active adapters of one forward, per site: A [S*R, in], B^T [S*R, out], and A as [S, in, R] for
    the chunked form (a transposed view up to `_TRANSPOSED_A_MAX_RANK`; None: no adapter has the site).
    `halves`: B^T split by output column halves, [2, S*R, out/2], built for a site the first time a
    forward asks (`LoraBatch.add_halves_`)."""

    num_slots: int
    sites: dict[str, tuple[Tensor, Tensor, Tensor] | None]
    halves: dict[str, Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, adapters: Sequence[FusedAdapter], site_names: Sequence[str]) -> _Stack:
        sites: dict[str, tuple[Tensor, Tensor, Tensor] | None] = {}
        s = len(adapters)
        for site in site_names:
            present = [a.sites[site] for a in adapters if site in a.sites]
            if not present:
                sites[site] = None
                continue
            rank = max(a.shape[0] for a, _ in present)
            ref_a, ref_b = present[0]
            a_cat = ref_a.new_zeros(s * rank, ref_a.shape[1])
            b_cat = ref_b.new_zeros(s * rank, ref_b.shape[1])
            for slot, adapter in enumerate(adapters):
                if site in adapter.sites:
                    a, b_t = adapter.sites[site]
                    a_cat[slot * rank : slot * rank + a.shape[0]] = a
                    b_cat[slot * rank : slot * rank + b_t.shape[0]] = b_t
            a_chunks = a_cat.view(s, rank, -1).transpose(1, 2)
            if rank > _TRANSPOSED_A_MAX_RANK:
                a_chunks = a_chunks.contiguous()
            sites[site] = (a_cat, b_cat, a_chunks)
        return cls(s, sites)

    def b_halves(self, site: str, b_t: Tensor) -> Tensor:
        """The site's B^T [S*R, out] as [2, S*R, out/2]: the first and the second half of its columns."""
        halves = self.halves.get(site)
        if halves is None:
            halves = b_t.view(b_t.shape[0], 2, -1).transpose(0, 1).contiguous()
            self.halves[site] = halves
        return halves


class LoraBatch:
    """The LoRA of one forward: the stacked active adapters, a slot mask [rows, S, 1] (0: no adapter), and
    whether the rows come as S equal runs, one per slot in slot order (then the chunked form applies)."""

    def __init__(self, stack: _Stack, mask: Tensor, chunked: bool) -> None:
        self.stack, self.mask, self.chunked = stack, mask, chunked

    def per_token(self, tokens: int) -> LoraBatch:
        """For `tokens` consecutive rows (positions) per sequence row, e.g. a right-padded prefill."""
        if tokens == 1:
            return self
        return LoraBatch(self.stack, self.mask.repeat_interleave(tokens, dim=0), self.chunked)

    def per_row_tokens(self, lengths: Sequence[int]) -> LoraBatch:
        """For lengths[i] consecutive rows (tokens) per sequence row i, e.g. a packed prefill. Rows of
        unequal lengths take the masked-dense form (the chunked one needs equal runs)."""
        if len(set(lengths)) == 1:
            return self.per_token(lengths[0])
        counts = torch.tensor(list(lengths), device=self.mask.device)
        return LoraBatch(self.stack, self.mask.repeat_interleave(counts, dim=0), chunked=False)

    def select(self, mask: Tensor) -> LoraBatch:
        """The same adapters over other rows, each row's slot given by `mask` (masked-dense form)."""
        return LoraBatch(self.stack, mask, chunked=False)

    def delta(self, site: str, x: Tensor) -> Tensor | None:
        """scale * B A x per row of x [rows, in] -> [rows, out]; None where no active adapter has `site`."""
        operands = self.stack.sites[site]
        if operands is None:
            return None
        a, b_t, a_chunks = operands
        if self.chunked and self.stack.num_slots == 1:
            return (x @ a_chunks[0]) @ b_t
        if self.chunked:
            h = torch.bmm(x.view(self.stack.num_slots, -1, x.shape[1]), a_chunks)
            return torch.bmm(h, b_t.view(self.stack.num_slots, -1, b_t.shape[1])).view(x.shape[0], -1)
        return self._masked_h(x, a) @ b_t

    def add_(self, out: Tensor, site: str, x: Tensor) -> None:
        """out [rows, out] (contiguous) += each row's scale * B A x, accumulated in place (no temporary)."""
        operands = self.stack.sites[site]
        if operands is None:
            return
        a, b_t, a_chunks = operands
        s = self.stack.num_slots
        if self.chunked and s == 1:  # one adapter for every row: plain mm/addmm (a batch of one costs more)
            out.addmm_(x @ a_chunks[0], b_t)
        elif self.chunked:
            h = torch.bmm(x.view(s, -1, x.shape[1]), a_chunks)
            out.view(s, -1, out.shape[1]).baddbmm_(h, b_t.view(s, -1, b_t.shape[1]))
        else:
            out.addmm_(self._masked_h(x, a), b_t)

    def add_halves_(self, out: Tensor, site: str, x: Tensor) -> None:
        """`add_` for an output computed as its two column halves, out [2, rows, out/2] (the runner's
        gate/up as a batch of two matmuls, one per thread): the same products, B^T split the same way, so
        the halves stay apart (no [rows, out] output to copy them into or out of)."""
        operands = self.stack.sites[site]
        if operands is None:
            return
        a, b_t, a_chunks = operands
        halves = self.stack.b_halves(site, b_t)  # [2, S*R, out/2]
        s, rows = self.stack.num_slots, x.shape[0]
        if self.chunked and s == 1:
            h = x @ a_chunks[0]  # [rows, R]
            out.baddbmm_(h.expand(2, *h.shape), halves)
        elif self.chunked:  # batch p * S + slot: half p of the rows of one slot
            h = torch.bmm(x.view(s, -1, x.shape[1]), a_chunks)  # [S, rows/S, R]
            h2 = h.expand(2, *h.shape).reshape(2 * s, -1, h.shape[2])
            out.view(2 * s, -1, out.shape[2]).baddbmm_(h2, halves.view(2 * s, -1, halves.shape[2]))
        else:
            h = self._masked_h(x, a)  # [rows, S*R]
            out.baddbmm_(h.expand(2, rows, h.shape[1]), halves)

    def _masked_h(self, x: Tensor, a: Tensor) -> Tensor:
        h = F.linear(x, a)
        h.view(x.shape[0], self.stack.num_slots, -1).mul_(self.mask)
        return h


class LoraStacks:
    """Builds `LoraBatch`es for a runner, keeping the stacks of the last few adapter sets and the batch of
    the last row assignment (consecutive decode steps usually repeat both). Driver thread only."""

    _KEPT = 4

    def __init__(self, site_names: Sequence[str], dtype: torch.dtype, device: torch.device) -> None:
        self.site_names, self.dtype, self.device = list(site_names), dtype, device
        self._stacks: dict[tuple[FusedAdapter, ...], _Stack] = {}
        self._last: tuple[tuple[FusedAdapter | None, ...], LoraBatch] | None = None

    def batch(self, adapters: Sequence[FusedAdapter | None]) -> LoraBatch | None:
        """For one adapter (or None) per row; None when no row uses one (the forward runs no LoRA at all)."""
        rows = tuple(adapters)
        if self._last is not None and self._last[0] == rows:
            return self._last[1]
        # Slots in order of first appearance, so rows grouped by adapter are the slots in order.
        slot_of: dict[FusedAdapter, int] = {}
        runs: list[list[Any]] = []  # [adapter, rows] of consecutive rows
        for a in rows:
            if a is not None and a not in slot_of:
                slot_of[a] = len(slot_of)
            if runs and runs[-1][0] is a:
                runs[-1][1] += 1
            else:
                runs.append([a, 1])
        if not slot_of:
            return None
        key = tuple(slot_of)
        stack = self._stacks.get(key)
        if stack is None:
            stack = _Stack.build(key, self.site_names)
            if len(self._stacks) >= self._KEPT:
                self._stacks.pop(next(iter(self._stacks)))
            self._stacks[key] = stack
        slots = torch.tensor([-1 if a is None else slot_of[a] for a in rows], device=self.device)
        # One-hot over S + 1 classes, the first being "no adapter", then dropped: rows without one get zeros.
        mask = F.one_hot(slots + 1, len(key) + 1)[:, 1:].to(self.dtype)[:, :, None]
        # Chunked: each adapter one run, runs of equal length, no base rows (no slot holds zeros).
        chunked = len(runs) == len(key) and len({n for _, n in runs}) == 1
        batch = LoraBatch(stack, mask, chunked)
        self._last = (rows, batch)
        return batch
