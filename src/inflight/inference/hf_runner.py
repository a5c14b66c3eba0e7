"""The generic `ModelRunner`: any Hugging Face causal LM, run by its own forward over the engine's cache rows.

Owns a private copy of the model and a K/V store of `max_batch_size` rows (row r's positions 0..p-1 at
columns 0..p-1, as in `qwen2.py`). Correct for any model whose layers cache keys and values through
`Cache.update`; slower than the fast path: every decode step copies the batch's K/V into a Hugging Face
`DynamicCache` and the model concatenates onto it, and prefill runs one forward per distinct prompt length.
It knows nothing about requests, sampling or versions.
"""

from __future__ import annotations

import copy
import inspect
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache

from inflight.errors import UserError
from inflight.inference.runner import ModelRunner


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


class HFRunner(ModelRunner[dict[str, Tensor]]):
    """Runs `model`'s forward (a deep copy, eval mode, parameters in `dtype`) over the engine's rows."""

    name = "hf"

    def __init__(self, model: Any, dtype: torch.dtype, max_batch_size: int, max_seq_len: int) -> None:
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.max_seq_len = max_seq_len
        arguments = inspect.signature(self.model.forward).parameters
        # transformers 5 renamed past_key_values to cache (the old name is deprecated, then removed).
        self._cache_kwarg = "cache" if "cache" in arguments else "past_key_values"
        self._keep_last = {"logits_to_keep": 1} if "logits_to_keep" in arguments else {}
        self._pass_positions = "position_ids" in arguments
        # Parameters take the engine's dtype; buffers in the state dict keep their own (integer buffers,
        # float32 statistics).
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
        with torch.inference_mode():
            self.install(self.snapshot(model.state_dict()))
            self.k_cache, self.v_cache, self.vocab_size = self._probe(max_batch_size)

    def snapshot(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        weights = {
            name: state_dict[name].detach().to(device="cpu", dtype=dtype, copy=True)
            for name, dtype in self._dtypes.items()
            if name in state_dict
        }
        for names in self._tied:
            source = next(n for n in names if n in weights)
            weights.update(dict.fromkeys(names, weights[source]))
        return weights

    def install(self, weights: dict[str, Tensor]) -> None:
        # assign=True adopts the snapshot's tensors (no copy); tied names get one tensor, so stay tied.
        self.model.load_state_dict(weights, strict=True, assign=True)

    def _probe(self, max_batch_size: int) -> tuple[list[Tensor], list[Tensor], int]:
        """One forward over two tokens: checks that every layer caches keys and values through the cache,
        and sizes the K/V store from what they cache."""
        unsupported = (
            f"{type(self.model).__name__} cannot run in the engine: neither path supports a model whose "
            "layers keep other state than one key/value cache each (recurrent, convolutional)"
        )
        try:
            logits, added = self._forward(torch.zeros(1, 2, dtype=torch.long), None, None, [], keep_last=True)
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
                store.append(torch.zeros(max_batch_size, heads, self.max_seq_len, head_dim, dtype=t.dtype))
        return k_store, v_store, int(logits.shape[-1])

    def _forward(
        self,
        ids: Tensor,
        mask: Tensor | None,
        positions: Tensor | None,
        past: list[tuple[Tensor, Tensor]],
        keep_last: bool,
    ) -> tuple[Tensor, dict[int, tuple[Tensor, Tensor]]]:
        """Logits [b, t or 1, V] (float32) and each layer's new K/V [b, heads, t, D]."""
        cache = _CapturingCache(past)
        kwargs: dict[str, Any] = {self._cache_kwarg: cache, "use_cache": True}
        if keep_last:
            kwargs.update(self._keep_last)
        if positions is not None and self._pass_positions:
            kwargs["position_ids"] = positions
        out = self.model(input_ids=ids, attention_mask=mask, **kwargs)
        logits = out.logits[:, -1:] if keep_last else out.logits
        return logits.float(), cache.added

    def prefill(self, prompts: list[list[int]], row0: int) -> Tensor:
        logits = torch.empty(len(prompts), self.vocab_size)
        for rows, out in self._prefill(prompts, row0):
            logits[rows] = out[:, -1]
        return logits

    def fill_cache(self, prefixes: list[list[int]], row0: int) -> None:
        for _ in self._prefill(prefixes, row0):
            pass

    def _prefill(self, prompts: list[list[int]], row0: int) -> Iterator[tuple[list[int], Tensor]]:
        """Yields (rows, logits [g, 1, V]) per group of equal-length prompts, one unpadded forward each:
        no padding reaches a model whose handling of it is unknown, and RL groups share their prompt."""
        by_length: dict[int, list[int]] = defaultdict(list)
        for i, p in enumerate(prompts):
            by_length[len(p)].append(i)
        for length, rows in by_length.items():
            ids = torch.tensor([prompts[i] for i in rows])
            positions = torch.arange(length).expand(len(rows), length)
            logits, added = self._forward(ids, torch.ones_like(ids), positions, [], keep_last=True)
            index = torch.tensor(rows) + row0
            for layer, (k, v) in added.items():
                self.k_cache[layer][index, :, :length] = k
                self.v_cache[layer][index, :, :length] = v
            yield rows, logits

    def decode(self, tokens: Tensor, positions: Tensor) -> Tensor:
        # The batch's cache, left-padded: row r's positions 0..p_r-1 at columns span-p_r..span-1, so that
        # the new token of every row lands at column `span`, one column distance per token distance (a
        # model's sliding window counts columns). Pad columns are masked out.
        n, span = tokens.shape[0], int(positions.max())
        source = torch.arange(span) - (span - positions)[:, None]  # [n, span]: a row's position per column
        valid = source >= 0
        rows, columns = torch.arange(n)[:, None], source.clamp_min(0)

        def left_padded(store: Tensor) -> Tensor:  # [rows, heads, positions, D] -> [n, heads, span, D]
            return store[rows, :, columns].transpose(1, 2)

        past = [(left_padded(kc), left_padded(vc)) for kc, vc in zip(self.k_cache, self.v_cache, strict=True)]
        mask = torch.cat([valid, torch.ones(n, 1, dtype=torch.bool)], dim=1).long()
        logits, added = self._forward(tokens[:, None], mask, positions[:, None], past, keep_last=True)
        for layer, (k, v) in added.items():
            self.k_cache[layer][torch.arange(n), :, positions] = k[:, :, 0]
            self.v_cache[layer][torch.arange(n), :, positions] = v[:, :, 0]
        return logits[:, 0]

    def move_row(self, src: int, dst: int, length: int) -> None:
        for kc, vc in zip(self.k_cache, self.v_cache, strict=True):
            kc[dst, :, :length] = kc[src, :, :length]
            vc[dst, :, :length] = vc[src, :, :length]

    def full_logits(self, token_ids: list[int]) -> Tensor:
        ids = torch.tensor([token_ids])
        out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        return out.logits[0].float()
