"""The generic `ModelRunner`: any Hugging Face causal LM, run by its own forward over the engine's cache rows.

Owns a private copy of the model and a K/V store of `max_batch_size` rows (row r's positions 0..p-1 at
columns 0..p-1, as in `qwen2.py`). Correct for any model whose layers cache keys and values through
`Cache.update`; slower than the fast path: every decode step copies the batch's K/V into a Hugging Face
`DynamicCache` and the model concatenates onto it, and prefill runs one forward per distinct prompt length.
LoRA adapters per row through `models/lora.py`'s multi-LoRA layers, wrapped around the copy's attention,
MLP and LM-head linears (with no plan they run the bare layer). It knows nothing about requests, sampling
or versions.
"""

from __future__ import annotations

import copy
import inspect
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache

from inflight.errors import UserError
from inflight.inference.adapters import AdapterModules
from inflight.inference.runner import ModelRunner
from inflight.models.lora import LoraPlan, LoraRouter, attach_multi_lora
from inflight.models.lora_adapter import LoraAdapter


class _CapturingCache(DynamicCache):
    """A DynamicCache (full-attention layers, whatever the config says: the model's mask applies any window)
    that also keeps the K/V each layer adds during one forward, for the runner to copy into its rows."""

    def __init__(self, past: list[tuple[Tensor, Tensor]] | None = None) -> None:
        super().__init__()
        for layer, (k, v) in enumerate(past or []):
            super().update(k, v, layer)
        self.added: dict[int, tuple[Tensor, Tensor]] = {}

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> Any:
        self.added[layer_idx] = (key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class HFRunner(ModelRunner[dict[str, Tensor], LoraAdapter]):
    """Runs `model`'s forward (a deep copy on `device`, eval mode, parameters in `dtype`) over the engine's
    rows."""

    name = "hf"

    def __init__(
        self, model: Any, dtype: torch.dtype, max_batch_size: int, max_seq_len: int, device: torch.device
    ) -> None:
        # Non-persistent buffers (rotary tables) are not in the state dict: the copy moves as a whole first.
        self.model = copy.deepcopy(model).to(device).eval().requires_grad_(False)
        self.max_seq_len, self.device, self._dtype = max_seq_len, device, dtype
        arguments = inspect.signature(self.model.forward).parameters
        # transformers 5 renamed past_key_values to cache (the old name is deprecated, then removed).
        self._cache_kwarg = "cache" if "cache" in arguments else "past_key_values"
        self._keep_last = {"logits_to_keep": 1} if "logits_to_keep" in arguments else {}
        self._pass_positions = "position_ids" in arguments
        # Parameters take the engine's dtype; buffers in the state dict keep their own (integer buffers,
        # float32 statistics). Names are the model's own (what a WeightUpdate carries).
        parameters = dict(self.model.named_parameters(remove_duplicate=False))
        self._dtypes = {
            name: dtype if name in parameters else t.dtype for name, t in self.model.state_dict().items()
        }
        # Names of one shared tensor (tied embeddings): copied once per update, installed under every name.
        by_tensor: dict[int, list[str]] = defaultdict(list)
        for name, p in parameters.items():
            by_tensor[id(p)].append(name)
        self._tied = [names for names in by_tensor.values() if len(names) > 1]
        self.optional_update_names = frozenset(n for names in self._tied for n in names[1:])
        self._router: LoraRouter | None
        try:
            self._router, self.lora_shapes = attach_multi_lora(self.model)
        except ValueError:  # no Llama/Qwen-named linears: this model takes no adapters (set_adapter says so)
            self._router, self.lora_shapes = None, {}
        # A wrapped layer's parameters live one level down (`q_proj.weight` -> `q_proj.base.weight`).
        wrapped = {f"{m}.{p}": f"{m}.base.{p}" for m in self.lora_shapes for p in ("weight", "bias")}
        self._module_name = {name: wrapped.get(name, name) for name in self._dtypes}
        self._plan: tuple[tuple[int, ...], LoraPlan] | None = None  # the last plan, by adapter ids per row
        with torch.inference_mode():
            self.install(self.snapshot(model.state_dict()))
            self.k_cache, self.v_cache, self.vocab_size = self._probe(max_batch_size)

    def snapshot(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        weights = {
            name: state_dict[name].detach().to(device=self.device, dtype=dtype, copy=True)
            for name, dtype in self._dtypes.items()
            if name in state_dict
        }
        for names in self._tied:
            source = next(n for n in names if n in weights)
            weights.update(dict.fromkeys(names, weights[source]))
        return weights

    def install(self, weights: dict[str, Tensor]) -> None:
        # assign=True adopts the snapshot's tensors (no copy); tied names get one tensor, so stay tied.
        renamed = {self._module_name[name]: t for name, t in weights.items()}
        self.model.load_state_dict(renamed, strict=True, assign=True)

    def snapshot_adapter(self, modules: AdapterModules, scale: float) -> LoraAdapter:
        rank = next(iter(modules.values()))[0].shape[0]
        return LoraAdapter(
            rank=rank,
            modules={
                m: (a.to(self.device, self._dtype), b.to(self.device, self._dtype))
                for m, (a, b) in modules.items()
            },
            alpha=scale * rank,  # LoraAdapter scales by alpha / rank
        )

    def _lora_plan(self, adapters: Sequence[LoraAdapter | None]) -> LoraPlan | None:
        """The multi-LoRA plan of a batch (None: no row has an adapter); the last one is reused while the
        rows' adapters stay the same (its stacked operands with it)."""
        if self._router is None or all(a is None for a in adapters):
            return None
        key = tuple(0 if a is None else id(a) for a in adapters)
        if self._plan is not None and self._plan[0] == key:
            return self._plan[1]
        slots: list[LoraAdapter | None] = [None]
        slot_of: dict[int, int] = {}
        for a in adapters:
            if a is not None and id(a) not in slot_of:
                slot_of[id(a)] = len(slots)
                slots.append(a)
        plan = LoraPlan(slots, [0 if a is None else slot_of[id(a)] for a in adapters])
        self._plan = (key, plan)
        return plan

    def _probe(self, max_batch_size: int) -> tuple[list[Tensor], list[Tensor], int]:
        """One forward over two tokens: checks that every layer caches keys and values through the cache,
        and sizes the K/V store from what they cache."""
        unsupported = (
            f"{type(self.model).__name__} cannot run in the engine: neither path supports a model whose "
            "layers keep other state than one key/value cache each (recurrent, convolutional)"
        )
        try:
            ids = torch.zeros(1, 2, dtype=torch.long, device=self.device)
            logits, added = self._forward(ids, None, None, [], keep_last=True, plan=None)
        except Exception as exc:  # whatever a forward that wants another cache raises: say what we know
            raise UserError(f"{unsupported} ({type(exc).__name__}: {exc})") from exc
        layers = sorted(added)
        # Each layer's K and V: [batch 1, heads, 2 positions, head dim].
        shapes = [t.shape for i in layers for t in added[i]]
        if (
            not layers
            or layers != list(range(len(layers)))
            or any(len(s) != 4 or (s[0], s[2]) != (1, 2) for s in shapes)
        ):
            raise UserError(unsupported)
        k_store: list[Tensor] = []
        v_store: list[Tensor] = []
        for i in layers:
            for store, t in zip((k_store, v_store), added[i], strict=True):
                heads, head_dim = t.shape[1], t.shape[3]
                store.append(
                    torch.zeros(
                        max_batch_size, heads, self.max_seq_len, head_dim, dtype=t.dtype, device=self.device
                    )
                )
        return k_store, v_store, int(logits.shape[-1])

    def _forward(
        self,
        ids: Tensor,
        mask: Tensor | None,
        positions: Tensor | None,
        past: list[tuple[Tensor, Tensor]],
        keep_last: bool,
        plan: LoraPlan | None,
    ) -> tuple[Tensor, dict[int, tuple[Tensor, Tensor]]]:
        """Logits [b, t or 1, V] (float32) and each layer's new K/V [b, heads, t, D]."""
        cache = _CapturingCache(past)
        kwargs: dict[str, Any] = {self._cache_kwarg: cache, "use_cache": True}
        if keep_last:
            kwargs.update(self._keep_last)
        if positions is not None and self._pass_positions:
            kwargs["position_ids"] = positions
        if self._router is None:
            out = self.model(input_ids=ids, attention_mask=mask, **kwargs)
        else:
            with self._router.use(plan):
                out = self.model(input_ids=ids, attention_mask=mask, **kwargs)
        logits = out.logits[:, -1:] if keep_last else out.logits
        return logits.float(), cache.added

    def prefill(
        self,
        prompts: list[list[int]],
        row0: int,
        adapters: Sequence[LoraAdapter | None],
        full_rows: Sequence[int] = (),
    ) -> tuple[Tensor, dict[int, Tensor]]:
        logits = torch.empty(len(prompts), self.vocab_size, device=self.device)
        full: dict[int, Tensor] = {}
        for rows, out in self._prefill(prompts, row0, adapters, set(full_rows)):
            logits[rows] = out[:, -1]
            full.update((i, out[j]) for j, i in enumerate(rows) if i in full_rows)
        return logits, full

    def fill_cache(
        self, prefixes: list[list[int]], row0: int, adapters: Sequence[LoraAdapter | None]
    ) -> None:
        for _ in self._prefill(prefixes, row0, adapters, set()):
            pass

    def _prefill(
        self, prompts: list[list[int]], row0: int, adapters: Sequence[LoraAdapter | None], full_rows: set[int]
    ) -> Iterator[tuple[list[int], Tensor]]:
        """Yields (rows, logits [g, 1 or P, V]: every position if a row of the group is in `full_rows`) per
        group of equal-length prompts, one unpadded forward each: no padding reaches a model whose handling
        of it is unknown, and RL groups share their prompt."""
        by_length: dict[int, list[int]] = defaultdict(list)
        for i, p in enumerate(prompts):
            by_length[len(p)].append(i)
        for length, rows in by_length.items():
            ids = torch.tensor([prompts[i] for i in rows], device=self.device)
            positions = torch.arange(length, device=self.device).expand(len(rows), length)
            plan = self._lora_plan([adapters[i] for i in rows])
            keep_last = not full_rows.intersection(rows)
            logits, added = self._forward(ids, torch.ones_like(ids), positions, [], keep_last, plan)
            index = torch.tensor(rows, device=self.device) + row0
            for layer, (k, v) in added.items():
                self.k_cache[layer][index, :, :length] = k
                self.v_cache[layer][index, :, :length] = v
            yield rows, logits

    def decode(
        self, tokens: list[int], positions: list[int], adapters: Sequence[LoraAdapter | None]
    ) -> Tensor:
        # The batch's cache, left-padded: row r's positions 0..p_r-1 at columns span-p_r..span-1, so that
        # the new token of every row lands at column `span`, one column distance per token distance (a
        # model's sliding window counts columns). Pad columns are masked out.
        n, span = len(tokens), max(positions)  # from the host's list: no device sync
        position = torch.tensor(positions, device=self.device)
        source = (
            torch.arange(span, device=self.device) - (span - position)[:, None]
        )  # a row's position per column
        valid = source >= 0
        rows, columns = torch.arange(n, device=self.device)[:, None], source.clamp_min(0)

        def left_padded(store: Tensor) -> Tensor:  # [rows, heads, positions, D] -> [n, heads, span, D]
            return store[rows, :, columns].transpose(1, 2)

        past = [(left_padded(kc), left_padded(vc)) for kc, vc in zip(self.k_cache, self.v_cache, strict=True)]
        mask = torch.cat([valid, torch.ones(n, 1, dtype=torch.bool, device=self.device)], dim=1).long()
        ids = torch.tensor(tokens, device=self.device)[:, None]
        plan = self._lora_plan(adapters)
        logits, added = self._forward(ids, mask, position[:, None], past, keep_last=True, plan=plan)
        every_row = torch.arange(n, device=self.device)
        for layer, (k, v) in added.items():
            self.k_cache[layer][every_row, :, position] = k[:, :, 0]
            self.v_cache[layer][every_row, :, position] = v[:, :, 0]
        return logits[:, 0]

    def move_row(self, src: int, dst: int, length: int) -> None:
        for kc, vc in zip(self.k_cache, self.v_cache, strict=True):
            kc[dst, :, :length] = kc[src, :, :length]
            vc[dst, :, :length] = vc[src, :, :length]

    def clear_row(self, row: int) -> None:
        for kc, vc in zip(self.k_cache, self.v_cache, strict=True):
            kc[row].zero_()
            vc[row].zero_()

    def full_logits(self, token_ids: list[int], adapter: LoraAdapter | None = None) -> Tensor:
        ids = torch.tensor([token_ids], device=self.device)
        if self._router is None:
            out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        else:
            with self._router.use(self._lora_plan([adapter])):
                out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        return out.logits[0].float()
