"""The decoder's last layer computed where the loss looks: its MLP (and the residual add after it) only at
the positions whose hidden states the trainer keeps, its attention everywhere.

The trainer reads the last hidden states only at the trained positions (the LM head runs there alone), and
in a layer only attention mixes positions: a position's MLP output in the last layer reaches nothing but
its own final hidden state. So at every other position that MLP can be skipped; the layer's attention
still runs at every position, because the kept positions attend to all of them. The result at the kept
positions is the full layer's (up to float rounding), and so are the gradients.
`make run`'s batch keeps 384 of ~1,700 positions; the MLP is ~80% of a layer's multiply-adds at the tiny
model's shapes, so a one-thread training step went from 256.8 to 220.3 ms (docs/benchmarks.md).

Only for the families whose decoder layer is exactly `x + attn(norm(x))`, then `h + mlp(norm(h))` with
these module names (Qwen2, Qwen3, Llama, Mistral): another family with the same names may order its norms
differently (Gemma 2 normalises the attention output before the residual add).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

from torch import Tensor, nn

# model_type -> the decoder layer is input_layernorm / self_attn / residual / post_attention_layernorm /
# mlp / residual, as in transformers' Qwen2DecoderLayer.
_FAMILIES = frozenset({"qwen2", "qwen3", "llama", "mistral"})
_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def trimmable_last_layer(model: nn.Module) -> nn.Module | None:
    """The last decoder layer of `model` (a causal LM) if its family's layer has the structure above."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in _FAMILIES:
        return None
    get_decoder = getattr(model, "get_decoder", None)
    layers = getattr(get_decoder() if callable(get_decoder) else None, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        return None
    layer: nn.Module = layers[-1]
    return layer if all(isinstance(getattr(layer, p, None), nn.Module) for p in _PARTS) else None


@contextlib.contextmanager
def last_layer_at(layer: nn.Module, flat_positions: Tensor) -> Iterator[None]:
    """Within this block, `layer`'s MLP runs only at `flat_positions` (unique indices into its output viewed
    as [rows * length, hidden]); the other positions carry the attention's output plus the residual."""

    attn_norm, attn, mlp_norm, mlp = (cast(nn.Module, getattr(layer, p)) for p in _PARTS)

    def forward(hidden_states: Tensor, **kwargs: Any) -> Tensor:  # the decoder passes the rest by keyword
        attended, _ = attn(hidden_states=attn_norm(hidden_states), **kwargs)
        hidden = hidden_states + attended
        flat = hidden.reshape(-1, hidden.shape[-1])
        kept = flat.index_select(0, flat_positions)
        kept = kept + mlp(mlp_norm(kept))
        return flat.index_copy(0, flat_positions, kept).view_as(hidden)

    layer.forward = forward  # an instance attribute: Module.__call__ finds it before the class's
    try:
        yield
    finally:
        del layer.forward
