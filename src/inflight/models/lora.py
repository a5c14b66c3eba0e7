"""Many LoRA adapters over one frozen base model in one batched forward: each row of the batch uses its own
adapter (or none), chosen by a per-row slot index.

A hand-written layer, because PEFT applies one active adapter (or a fixed mix) to the whole batch; it cannot
train several adapters, each with its own optimizer, in one forward pass. Owns the per-row routing and the
math; the adapters' parameters are `lora_adapter.LoraAdapter`s owned by the caller.

Two exact ways to apply a mixed batch (the tests hold both to the explicit formula), chosen by shape from
measurements on CPU (tiny model widths, all 28 LoRA modules, rank 32, 1 thread, best of 10-15). Rows of one
adapter form a run (the engine sorts rows by adapter).
- Gathered: the runs are cut into chunks of c rows, c the gcd of the runs' lengths (so no chunk is padded;
  equal runs, the usual case, are one chunk each); adapters are zero-padded to the batch's largest rank and
  stacked; each chunk takes its A and B from the stacks (no copy when the chunks are the slots in order),
  and two bmm cover all rows. Padded ranks are exact zeros, so no value or gradient changes. Used for many
  tokens per row (training, prefill), and for one token per row when no weights need gathering. 8 adapters
  x 2 rows x 64 tokens, fwd+bwd: 45 ms against 64 ms for the earlier form that gathered A/B per row (and
  67 ms grouped); with runs of unequal length (chunks of one row) 57 ms against 65.
- Grouped, for a single adapter, or one token per row with weights to gather: each run does two plain
  matmuls at its own rank. 64 decode rows of 8 adapters, one run of 57 rows and seven of 1: 4.6 ms
  against 18.6 ms gathered (per-row weight copies dominate); in 8 equal runs of 8 rows the gathered
  form wins, 3.0 ms against 4.7.
When the rows come sorted (no permutation), the base layer is frozen and the form is gathered (but for
decode rows that gather weights) or a single adapter, `LoraLinearFunction` runs the layer and its LoRA as
one autograd node, accumulating the LoRA product into the base output and input gradient (see there).
On a GPU a fused segmented kernel (Punica's SGMV) would beat both; that is out of scope here.

Without autograd (sampling), the batches the fused node does not take run `LoraPlan.apply_grouped`: the
grouped form with each run's product accumulated in place into the base output, the fused node's ops
for one chunk.

Precision: every form runs the LoRA matmuls in the dtype of the layer's input (the base weights'), casting
float32 adapters to it differentiably, as autocast does; their gradients and optimizer stay float32. Under
bfloat16 a separate LoRA sum would round twice and the fused node once, so a row's numerics would depend
on the form its batch took; with sampling always accumulating in place, a seeded sample is the same alone
or in any batch (tested).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from inflight.models.lora_adapter import ATTN_TARGETS, MLP_TARGETS, UNEMBED_TARGETS, LoraAdapter

LORA_SUFFIXES = ATTN_TARGETS + MLP_TARGETS + UNEMBED_TARGETS


class LoraPlan:
    """Which adapter each batch row uses: `slots[row_slot[b]]` for row b (None = the bare base model).

    Stacked, padded A/B per module are built on first use and kept for the plan's life (a sampling run
    reuses them every decode step); build a new plan after an adapter's weights change.
    """

    def __init__(self, slots: Sequence[LoraAdapter | None], row_slot: Sequence[int] | Tensor) -> None:
        self.slots = list(slots)
        self.row_slot = torch.as_tensor(row_slot, dtype=torch.long)
        self._stacks: dict[str, tuple[Tensor, Tensor] | None] = {}
        self._fused: dict[str, tuple[Tensor, Tensor] | None] = {}
        self._single: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
        slot_list = self.row_slot.tolist()
        if slot_list and (min(slot_list) < 0 or max(slot_list) >= len(self.slots)):
            raise ValueError(
                f"row_slot values must lie in [0, {len(self.slots)}), got {sorted(set(slot_list))}"
            )
        # Runs (slot, start, end) of the rows sorted by slot, for the grouped form; the permutation is None
        # when the rows already come sorted (the engine sorts them).
        order = sorted(range(len(slot_list)), key=slot_list.__getitem__)
        self._permutation: tuple[Tensor, Tensor] | None = None  # (rows in slot order, its inverse)
        if order != list(range(len(order))):
            forward = torch.tensor(order)
            self._permutation = (
                forward,
                torch.empty_like(forward).scatter_(0, forward, torch.arange(len(order))),
            )
        self._segments: list[tuple[int, int, int]] = []
        for position, row in enumerate(order):
            if self._segments and self._segments[-1][0] == slot_list[row]:
                self._segments[-1] = (slot_list[row], self._segments[-1][1], position + 1)
            else:
                self._segments.append((slot_list[row], position, position + 1))
        # The gathered form cuts the sorted rows into chunks of `_chunk_rows` rows of one adapter: the gcd of
        # the runs' lengths, so chunks need no padding and equal runs (the usual case) are one chunk each.
        # `_chunk_slot` is None when the chunks are exactly the slots in order (the stacks need no gather).
        self._chunk_rows = math.gcd(*(end - start for _, start, end in self._segments)) or 1
        chunk_slot = [
            slot for slot, start, end in self._segments for _ in range((end - start) // self._chunk_rows)
        ]
        self._chunk_slot = None if chunk_slot == list(range(len(self.slots))) else torch.tensor(chunk_slot)

    @property
    def num_rows(self) -> int:
        return int(self.row_slot.numel())

    def select_rows(self, rows: Tensor) -> LoraPlan:
        """The plan for a batch reduced to `rows` (finished sequences dropped); shares the stacks."""
        plan = LoraPlan(self.slots, self.row_slot[rows.to(self.row_slot.device)])
        plan._stacks = self._stacks
        return plan

    def delta(self, module: str, x: Tensor) -> Tensor | None:
        """scale * B A x for each row's adapter; x [b, t, in] -> [b, t, out] in x's dtype (adapters of another
        dtype are cast to it, differentiably), or None if no adapter in the batch trains `module`."""
        if x.dim() != 3 or x.shape[0] != self.num_rows:
            raise ValueError(
                f"LoRA module {module}: expected input [rows={self.num_rows}, tokens, features], "
                f"got {tuple(x.shape)}"
            )
        if not any(s is not None and module in s.modules for s in self.slots):
            return None
        # One token per row with weights to gather per chunk: the copies outweigh the matmuls (see above).
        if len(self._segments) == 1 or (x.shape[1] == 1 and self._chunk_slot is not None):
            return self._grouped(module, x)
        return self._gathered(module, x)

    def fused_operands(self, module: str, x: Tensor, base: nn.Linear) -> tuple[Tensor, Tensor] | None:
        """(A [C, R, in], scale-folded B [C, out, R]) when `module`'s LoRA can run fused into its base layer
        (`LoraLinearFunction`): the rows come in slot order as C equal chunks of one adapter each, x in
        the base weights' dtype, and a frozen base. None: use `delta` (any other case). Cached per plan."""
        if x.dim() != 3 or x.shape[0] != self.num_rows or self._permutation is not None:
            return None
        if base.weight.requires_grad or x.dtype != base.weight.dtype:
            return None
        if x.shape[1] == 1 and len(self._segments) > 1 and self._chunk_slot is not None:
            return None  # decode rows that would gather weights: the grouped form is faster
        if module not in self._fused:
            operands = self._fused_operands(module, x.device)
            if operands is not None and operands[0].dtype != x.dtype:  # differentiable: grads stay float32
                operands = (operands[0].to(x.dtype), operands[1].to(x.dtype))
            self._fused[module] = operands
        return self._fused[module]

    def _fused_operands(self, module: str, device: torch.device) -> tuple[Tensor, Tensor] | None:
        if len(self._segments) == 1:  # one adapter for every row: its own A/B, at its own rank
            adapter = self.slots[self._segments[0][0]]
            if adapter is None or module not in adapter.modules:
                return None
            a, b = adapter.modules[module]
            return a[None], (b if adapter.scale == 1.0 else b * adapter.scale)[None]
        return self._chunk_stacks(module, device)

    def apply_grouped(self, module: str, x: Tensor, base: nn.Linear) -> Tensor:
        """base(x) + each row's LoRA without autograd, each run of one adapter accumulating its product into
        the base output in place (`addmm_`): the ops, and so the rounding, of `LoraLinearFunction` with one
        chunk, whatever the batch. Sampling decodes through here and through the fused node; a sequence
        then rounds alike alone or in any batch, which keeps seeded samples batch-independent in bfloat16
        (a separate LoRA sum rounds twice)."""
        if not any(s is not None and module in s.modules for s in self.slots):
            return F.linear(x, base.weight, base.bias)
        xs = self._to_slot_order(x)
        out = F.linear(xs, base.weight, base.bias)
        out_2d = out.view(-1, out.shape[-1])
        tokens = x.shape[1]
        for slot, start, end in self._segments:
            adapter = self.slots[slot]
            if adapter is None or module not in adapter.modules:
                continue
            a, b = self._own_operands(adapter, module, x.dtype)
            x_2d = xs[start:end].reshape(-1, x.shape[-1])
            out_2d[start * tokens : end * tokens].addmm_(torch.mm(x_2d, a.t()), b.t())
        return self._to_row_order(out)

    def _own_operands(self, adapter: LoraAdapter, module: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """One adapter's A and scale-folded B in `dtype`, cached for the plan's life."""
        key = (id(adapter), module)
        if key not in self._single:
            a, b = adapter.modules[module]
            b = b if adapter.scale == 1.0 else b * adapter.scale
            self._single[key] = (a.to(dtype), b.to(dtype))
        return self._single[key]

    def _chunk_stacks(self, module: str, device: torch.device) -> tuple[Tensor, Tensor] | None:
        """Each chunk's padded A [C, R, in] and scale-folded B [C, out, R]: the stacks as they are when the
        chunks are the slots in order, else gathered by chunk (unequal runs). None if no adapter trains
        `module`."""
        stacks = self._stacked(module)
        if stacks is None or self._chunk_slot is None:
            return stacks
        if self._chunk_slot.device != device:  # moved once, not once per layer
            self._chunk_slot = self._chunk_slot.to(device)
        return stacks[0][self._chunk_slot], stacks[1][self._chunk_slot]

    def _grouped(self, module: str, x: Tensor) -> Tensor:
        """Two plain matmuls per run of rows with the same adapter."""
        xs = self._to_slot_order(x)
        out_features = next(s.modules[module][1].shape[0] for s in self.slots if s and module in s.modules)
        pieces = []
        for slot, start, end in self._segments:
            adapter = self.slots[slot]
            if adapter is None or module not in adapter.modules:  # bare base model, or module not trained
                pieces.append(x.new_zeros(end - start, x.shape[1], out_features))
                continue
            a, b = adapter.modules[module]
            # The scale on the rank-sized h, not on the wide output: one small elementwise op.
            pieces.append(F.linear(F.linear(xs[start:end], a.to(x.dtype)) * adapter.scale, b.to(x.dtype)))
        return self._to_row_order(pieces[0] if len(pieces) == 1 else torch.cat(pieces))

    def _gathered(self, module: str, x: Tensor) -> Tensor:
        """Rows in slot order as chunks of `_chunk_rows` rows ([C, c*T, in], a view when the rows come
        sorted), each chunk's padded A and B ([C, R, in], [C, out, R]), then two bmm over the chunks."""
        chunk_stacks = self._chunk_stacks(module, x.device)
        assert chunk_stacks is not None  # delta() checked that some adapter trains the module
        a_S_R_I, b_S_O_R = chunk_stacks[0].to(x.dtype), chunk_stacks[1].to(x.dtype)
        rows, tokens = x.shape[:2]
        x_C_N_I = self._to_slot_order(x).reshape(a_S_R_I.shape[0], -1, x.shape[2])
        h_C_N_R = torch.bmm(x_C_N_I, a_S_R_I.transpose(1, 2))
        out_C_N_O = torch.bmm(h_C_N_R, b_S_O_R.transpose(1, 2))
        return self._to_row_order(out_C_N_O.reshape(rows, tokens, -1))

    def _to_slot_order(self, x: Tensor) -> Tensor:
        permutation = self._permutation
        if permutation is None:
            return x
        if permutation[0].device != x.device:  # moved once, not once per layer
            permutation = self._permutation = (permutation[0].to(x.device), permutation[1].to(x.device))
        return x.index_select(0, permutation[0])

    def _to_row_order(self, out: Tensor) -> Tensor:
        return out if self._permutation is None else out.index_select(0, self._permutation[1])

    def _stacked(self, module: str) -> tuple[Tensor, Tensor] | None:
        if module not in self._stacks:
            self._stacks[module] = self._stack(module)
        return self._stacks[module]

    def _stack(self, module: str) -> tuple[Tensor, Tensor] | None:
        """A [S, R, in] and scale-folded B [S, out, R] over the slots, zero-padded to the largest rank R.

        Built from the adapters' leaf tensors with differentiable ops (stack, and pad and mul only where
        ranks or scales differ), so the backward pass of the batched matmuls lands in each adapter's own
        A/B gradients. Each op here is a node in every backward pass, so there are as few as possible.
        """
        present = [s.modules[module] for s in self.slots if s is not None and module in s.modules]
        if not present:
            return None
        max_rank = max(a.shape[0] for a, _ in present)
        ref_a, ref_b = present[0]
        zeros_a = ref_a.new_zeros(max_rank, ref_a.shape[1])
        zeros_b = ref_b.new_zeros(ref_b.shape[0], max_rank)
        a_list, b_list, scales = [], [], []
        for slot in self.slots:
            if slot is None or module not in slot.modules:  # bare base model, or module not trained
                a_list.append(zeros_a)
                b_list.append(zeros_b)
                scales.append(1.0)
                continue
            a, b = slot.modules[module]
            pad = max_rank - a.shape[0]
            a_list.append(F.pad(a, (0, 0, 0, pad)) if pad else a)
            b_list.append(F.pad(b, (0, pad)) if pad else b)
            scales.append(slot.scale)
        b_S_O_R = torch.stack(b_list)
        if any(scale != 1.0 for scale in scales):
            b_S_O_R = (
                b_S_O_R * torch.tensor(scales, dtype=b_S_O_R.dtype, device=b_S_O_R.device)[:, None, None]
            )
        return torch.stack(a_list), b_S_O_R


class LoraLinearFunction(torch.autograd.Function):
    """y = x W^T + bias + B_c A_c x for the rows of chunk c, as one autograd node over a frozen base layer.

    The same math as `MultiLoraLinear`'s two-step form (base layer, then `LoraPlan.delta` added), but the
    LoRA product accumulates into the base output inside the batched matmul (`baddbmm_`, beta = 1) and,
    in backward, into the input gradient of the base layer: no [tokens, out] sum in forward and no
    [tokens, in] sum in backward, and one autograd node instead of about six. Forward + backward over the
    tiny model, A/B alternating in one process: 8 adapters x 2 rows x 64 tokens 7% faster, one adapter's
    2 x 64 tokens 10%.
    One dtype throughout: under half-precision base weights `LoraPlan.fused_operands` passes the float32
    adapters cast to it, as autocast would.
    Hand-written because no library fuses a per-chunk LoRA into its base matmul on CPU.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, a_C_R_I: Tensor, b_C_O_R: Tensor
    ) -> Tensor:
        chunks = a_C_R_I.shape[0]
        x_C_N_I = x.reshape(chunks, -1, x.shape[-1])
        out = F.linear(x, weight, bias)  # a new contiguous tensor: the LoRA term accumulates into it
        h_C_N_R = _bmm(x_C_N_I, a_C_R_I.transpose(1, 2))
        _baddbmm_(out.view(chunks, -1, out.shape[-1]), h_C_N_R, b_C_O_R.transpose(1, 2))
        ctx.save_for_backward(x_C_N_I, h_C_N_R, weight, a_C_R_I, b_C_O_R)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, None, None, Tensor, Tensor]:
        x_C_N_I, h_C_N_R, weight, a_C_R_I, b_C_O_R = ctx.saved_tensors
        g_C_N_O = grad_out.reshape(b_C_O_R.shape[0], -1, grad_out.shape[-1])
        grad_h_C_N_R = _bmm(g_C_N_O, b_C_O_R)
        grad_b = _bmm(g_C_N_O.transpose(1, 2), h_C_N_R)
        grad_a = _bmm(grad_h_C_N_R.transpose(1, 2), x_C_N_I)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x_M_I = torch.mm(grad_out.reshape(-1, grad_out.shape[-1]), weight)
            _baddbmm_(grad_x_M_I.view_as(x_C_N_I), grad_h_C_N_R, a_C_R_I)
            grad_x = grad_x_M_I.view(*grad_out.shape[:-1], weight.shape[1])
        return grad_x, None, None, grad_a, grad_b


# One chunk (a single adapter) takes mm/addmm_: a batched matmul of one matrix costs ~10 us more per call
# at these sizes (CPU, 2 threads), and a layer makes six.
def _bmm(x: Tensor, y: Tensor) -> Tensor:
    return torch.mm(x[0], y[0])[None] if x.shape[0] == 1 else torch.bmm(x, y)


def _baddbmm_(out: Tensor, x: Tensor, y: Tensor) -> None:
    if x.shape[0] == 1:
        out[0].addmm_(x[0], y[0])
    else:
        out.baddbmm_(x, y)


class LoraRouter:
    """Shared by all `MultiLoraLinear` layers of one model: holds the plan of the forward pass running now.

    Not thread-safe: one thread runs the model's forward passes (the service's engine loop).
    """

    def __init__(self) -> None:
        self.plan: LoraPlan | None = None

    @contextmanager
    def use(self, plan: LoraPlan | None) -> Iterator[None]:
        previous, self.plan = self.plan, plan
        try:
            yield
        finally:
            self.plan = previous


class MultiLoraLinear(nn.Module):
    """A frozen nn.Linear plus, per batch row, that row's adapter: y = W x + b + scale * B A x."""

    def __init__(self, base: nn.Linear, name: str, router: LoraRouter) -> None:
        super().__init__()
        self.base, self.name, self.router = base, name, router

    @property
    def weight(self) -> Tensor:  # some Hugging Face code reads lm_head.weight (dtype, tying checks)
        return self.base.weight

    @property
    def bias(self) -> Tensor | None:
        return self.base.bias

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: Tensor) -> Tensor:
        plan = self.router.plan
        if plan is None:
            return self.base(x)
        operands = plan.fused_operands(self.name, x, self.base)
        if operands is not None:
            output: Tensor = LoraLinearFunction.apply(x, self.base.weight, self.base.bias, *operands)
            return output
        if not torch.is_grad_enabled():
            return plan.apply_grouped(self.name, x, self.base)
        out = self.base(x)
        delta = plan.delta(self.name, x)
        return out if delta is None else out + delta


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(module name, layer) of `model`'s LoRA-able linear layers (attention, MLP, LM head), unwrapped."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in LORA_SUFFIXES
    ]


def attach_multi_lora(model: nn.Module) -> tuple[LoraRouter, dict[str, tuple[int, int]]]:
    """Freeze `model` and wrap its LoRA-able linear layers (attention, MLP, LM head) in place.

    Returns the router that selects adapters per forward pass and {module name: (in, out)} of the wrapped
    layers. Raises ValueError for a model with none of the Llama/Qwen layer names.
    """
    model.requires_grad_(False)
    router = LoraRouter()
    targets = lora_layers(model)
    if not targets:
        raise ValueError(
            f"{type(model).__name__} has no linear layers named {', '.join(LORA_SUFFIXES)}: "
            "multi-LoRA supports Llama/Qwen2/Qwen3-style models"
        )
    shapes = {}
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, MultiLoraLinear(linear, name, router))
        shapes[name] = (linear.in_features, linear.out_features)
    return router, shapes
