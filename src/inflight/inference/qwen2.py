"""The engine's own forward pass for Qwen2/Qwen2.5, Qwen3, Llama (with Llama 3's rope scaling) and Mistral,
over a weight snapshot, with a preallocated KV cache: the fast `ModelRunner`.

Owns the numerics (it must match HF's full-sequence forward in float32), the cache layout, and the test of
which models it reproduces exactly (`ModelSpec.from_hf_config`, `Weights.from_state_dict`: anything else
raises `UnsupportedModel`, and the engine runs it on `hf_runner`). It knows nothing about requests,
sampling or versions.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from inflight.inference.adapters import AdapterModules, FusedAdapter, LoraBatch, LoraStacks, SiteParts
from inflight.inference.runner import ModelRunner

# attend(layer, q [b, t, H, D], k [b, t, KV, D], v [b, t, KV, D]) -> [b * t, H * D]
Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]

# Model types whose HF forward is exactly this module's (pre-norm, SwiGLU, RMSNorm, RoPE, GQA). Checked by
# name: other types share these parameter names but not the numerics (Granite's multipliers, Gemma's
# 1 + weight norms), and must not pass for one of these.
FAST_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama", "mistral"})


class UnsupportedModel(ValueError):
    """The model needs something this forward does not implement; the message names it in one line."""


@dataclass(frozen=True)
class Llama3Rope:
    """Llama 3.1's rope scaling (rope_type "llama3"): low frequencies slowed by `factor`, a smooth ramp."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only model, read from a Hugging Face config."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    llama3_rope: Llama3Rope | None = None  # None: the default RoPE

    @classmethod
    def from_hf_config(cls, config: Any, max_seq_len: int) -> ModelSpec:
        """The spec, or UnsupportedModel when HF's forward does something this one does not (for sequences
        of up to `max_seq_len` tokens: a sliding window longer than that never slides)."""
        model_type = getattr(config, "model_type", None)
        if model_type not in FAST_MODEL_TYPES:
            raise UnsupportedModel(f"model_type {model_type!r} is not one of {sorted(FAST_MODEL_TYPES)}")
        rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise UnsupportedModel(f"rope_type {rope_type!r} (implemented: 'default', 'llama3')")
        partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
        if partial not in (None, 1, 1.0):
            raise UnsupportedModel(f"partial_rotary_factor={partial} (only full rotary embeddings)")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"hidden_act={config.hidden_act!r} (only SwiGLU, hidden_act='silu')")
        layer_types = set(getattr(config, "layer_types", None) or [])
        if layer_types - {"full_attention", "sliding_attention"}:
            raise UnsupportedModel(f"layer_types {sorted(layer_types)} (only full and sliding attention)")
        # Without layer_types (Mistral) a sliding_window applies to every layer.
        window = getattr(config, "sliding_window", None)
        if window is not None and window < max_seq_len and layer_types != {"full_attention"}:
            raise UnsupportedModel(
                f"sliding_window={window} is shorter than engine.max_seq_len_tokens={max_seq_len} "
                "(only attention over the whole sequence)"
            )
        llama3 = None
        if rope_type == "llama3":
            llama3 = Llama3Rope(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(
                    rope.get("original_max_position_embeddings") or config.max_position_embeddings
                ),
            )
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            llama3_rope=llama3,
        )


def rope_inv_freq(spec: ModelSpec) -> Tensor:
    """[head_dim / 2] inverse frequencies (float32), op for op as transformers computes them
    (`modeling_rope_utils._compute_llama3_parameters` for Llama 3), so the tables match HF's bitwise."""
    d = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(torch.float) / d))
    r = spec.llama3_rope
    if r is None:
        return inv_freq
    low_freq_wavelen = r.original_max_position_embeddings / r.low_freq_factor
    high_freq_wavelen = r.original_max_position_embeddings / r.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Wavelengths above low_freq_wavelen are slowed by `factor`, below high_freq_wavelen kept; in between,
    # a mix of both with a weight linear in context / wavelength.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / r.factor, inv_freq)
    smooth = (r.original_max_position_embeddings / wavelen - r.low_freq_factor) / (
        r.high_freq_factor - r.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


@dataclass(frozen=True)
class LayerWeights:
    # q/k/v and gate/up are fused into one matmul each (rows: q heads, k heads, v heads; gate, up).
    input_norm: Tensor
    qkv: Tensor
    qkv_bias: Tensor | None
    q_norm: Tensor | None  # Qwen3-style per-head norms
    k_norm: Tensor | None
    o_proj: Tensor
    o_bias: Tensor | None
    post_norm: Tensor
    gate_up: Tensor
    down: Tensor


@dataclass(frozen=True)
class Weights:
    """An immutable snapshot: the engine swaps the whole object, so a step never mixes two versions."""

    embed: Tensor
    layers: tuple[LayerWeights, ...]
    norm: Tensor
    lm_head: Tensor

    @classmethod
    def from_state_dict(
        cls, sd: dict[str, Tensor], spec: ModelSpec, dtype: torch.dtype, device: torch.device
    ) -> Weights:
        """Copies (cat/to always allocate), so the caller may keep mutating its own tensors."""

        used: set[str] = set()

        def get(name: str) -> Tensor:
            if name not in sd:
                raise UnsupportedModel(f"no parameter {name!r} (not the Qwen2/Llama layout)")
            used.add(name)
            return sd[name].detach().to(device=device, dtype=dtype, copy=True)

        def optional(names: list[str]) -> Tensor | None:  # biases and Qwen3's norms exist in some models
            return torch.cat([get(n) for n in names]) if names[0] in sd else None

        layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            qkv = [p + f"self_attn.{x}_proj" for x in "qkv"]
            layers.append(
                LayerWeights(
                    input_norm=get(p + "input_layernorm.weight"),
                    qkv=torch.cat([get(n + ".weight") for n in qkv]),
                    qkv_bias=optional([n + ".bias" for n in qkv]),
                    q_norm=optional([p + "self_attn.q_norm.weight"]),
                    k_norm=optional([p + "self_attn.k_norm.weight"]),
                    o_proj=get(p + "self_attn.o_proj.weight"),
                    o_bias=optional([p + "self_attn.o_proj.bias"]),
                    post_norm=get(p + "post_attention_layernorm.weight"),
                    gate_up=torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
                    down=get(p + "mlp.down_proj.weight"),
                )
            )
        embed = get("model.embed_tokens.weight")
        lm_head = embed if spec.tie_word_embeddings else get("lm_head.weight")
        norm = get("model.norm.weight")
        # Tied models: HF lists lm_head.weight too (the same tensor as the embedding); it is not read.
        unsupported = sorted(set(sd) - used - {"lm_head.weight"})
        if unsupported:
            more = f" and {len(unsupported) - 3} more" if len(unsupported) > 3 else ""
            raise UnsupportedModel(f"parameters the fast path does not use: {unsupported[:3]}{more}")
        return cls(embed=embed, layers=tuple(layers), norm=norm, lm_head=lm_head)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if x.dtype == torch.float32:  # the fused kernel is bitwise equal to HF's formula in float32
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # HF's order of operations: normalise in float32, cast back, then scale.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """RoPE as HF computes it, x * cos + rotate_half(x) * sin, with rotate_half(x) * sin written as
    roll(x) * signed_sin: the sign lives in the table (`Qwen2Runner.signed_sin`), which saves a negation
    and a cat per call and is bitwise the same (negation commutes with rounding). Not addcmul: its single
    rounding would depart from HF's in bfloat16.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


# Above this many attention scores (b * heads * t * t) causal attention uses SDPA's flash kernel, whose
# memory does not grow with t^2; below it, two batched matmuls beat it on CPU (64 prompts of 16 tokens:
# 1.2x with one thread, ~3x with two).
_MATERIALISED_SCORES_MAX = 1 << 20


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal GQA self-attention over q [b, t, H, D], k/v [b, t, KV, D] -> [b * t, H * D]."""
    b, t, nh, d = q.shape
    kv = k.shape[2]
    if b * nh * t * t > _MATERIALISED_SCORES_MAX:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, t, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * t, -1)
    # The rep query heads sharing a kv head become rep query rows per position of one (row, kv head) batch
    # entry: rows (position i, head r) -> i * rep + r, so the causal mask repeats each row rep times.
    rep = nh // kv
    queries = q.view(b, t, kv, rep, d).transpose(1, 2).reshape(b * kv, t * rep, d)
    keys, values = (x.transpose(1, 2).reshape(b * kv, t, d) for x in (k, v))
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu_(1).repeat_interleave(rep, dim=0)
    bias = torch.zeros(t * rep, t, dtype=q.dtype, device=q.device).masked_fill_(future, float("-inf"))
    scores = torch.baddbmm(bias, queries, keys.transpose(1, 2), alpha=d**-0.5)
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)  # float32, like HF's eager
    out = torch.bmm(probs, values).view(b, kv, t, rep, d)
    return out.transpose(1, 2).reshape(b * t, -1)


def add_linear(x: Tensor, a: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x + linear(a, weight, bias) for 2-D x and a: the residual add rides in the matmul (one op fewer).

    The sgemm adds x inside its accumulation (beta = 1), which can differ from HF's separate add by an ulp.
    """
    out = torch.addmm(x, a, weight.t())
    return out if bias is None else out.add_(bias)


# At most this many rows (tokens), gate_up_linear runs gate and up as a batch of two matmuls: MKL does not
# thread a matmul this small, while a batched matmul puts one matrix on each thread (8-64 decode rows,
# widths 128 -> 2 x 512, two threads: 1.2-1.6x the plain matmul; a whole bench-engine generate 7% faster,
# A/B alternating in one process). From a few hundred rows MKL threads the plain matmul as well. The same
# split of the LM head gains nothing: its two halves must be copied back into one [n, V] tensor.
_SPLIT_GATE_UP_MAX_ROWS = 256


def gate_up_linear(
    x: Tensor, gate_up: Tensor, lora: LoraBatch | None = None, site: str = ""
) -> tuple[Tensor, Tensor]:
    """(x W_gate^T, x W_up^T) for x [n, hidden] and the stacked gate_up [2 * inter, hidden], plus the LoRA
    of `lora` at `site` when given (accumulated into either layout of the output, no copy)."""
    n = x.shape[0]
    if n > _SPLIT_GATE_UP_MAX_ROWS or torch.get_num_threads() < 2:
        stacked = F.linear(x, gate_up)
        if lora is not None:
            lora.add_(stacked, site, x)
        gate, up = stacked.chunk(2, dim=-1)
        return gate, up
    out = torch.bmm(x.expand(2, n, x.shape[1]), gate_up.view(2, -1, x.shape[1]).transpose(1, 2))
    if lora is not None:
        lora.add_halves_(out, site, x)
    return out[0], out[1]


@dataclass(frozen=True)
class _Packed:
    """The new tokens of a packed prefill (`Qwen2Runner._packed_attention`): ids and positions [N], each
    row's count of them and where its run begins, and how they attend (storing their K/V)."""

    ids: Tensor
    positions: Tensor
    lengths: list[int]
    starts: list[int]
    attend: Attend


class Qwen2Runner(ModelRunner[Weights, FusedAdapter]):
    """Prefill and decode over cache rows; `weights` is replaced wholesale by `install`. LoRA adapters run
    in the forms of `adapters.py`, over the fused matmuls (q/k/v, gate/up) laid out as the base computes
    them (gate/up as its two halves, one per thread, up to `_SPLIT_GATE_UP_MAX_ROWS` rows)."""

    name = "fast"
    resumes_cached_prefix = True

    def __init__(
        self, spec: ModelSpec, weights: Weights, max_batch_size: int, max_seq_len: int, device: torch.device
    ) -> None:
        self.spec, self.weights, self.max_seq_len, self.device = spec, weights, max_seq_len, device
        self.dtype = weights.embed.dtype
        self.vocab_size = spec.vocab_size
        # Tied models: HF's state dict lists lm_head.weight too, the embedding under a second name.
        self.optional_update_names = frozenset({"lm_head.weight"} if spec.tie_word_embeddings else ())
        dtype = self.dtype
        shape = (max_batch_size, max_seq_len, spec.num_kv_heads, spec.head_dim)
        # k_cache[layer][row, position, kv_head]: active sequences occupy rows 0..n-1. Heads innermost, so
        # that a decode step writes a row's new K of all heads as one slot, and a row's keys over a span
        # are one [span * kv heads, D] matrix (see decode). All of them views of one tensor [K/V, layer,
        # ...], each layer's K and V still contiguous: moving a row (the prefix cache, a finished row's
        # place) is then one copy, not two a layer (~17 against ~68 us on 4 layers, EPYC Zen 3).
        self.kv_cache = torch.zeros((2, spec.num_layers, *shape), dtype=dtype, device=device)
        self.k_cache, self.v_cache = list(self.kv_cache[0]), list(self.kv_cache[1])
        # HF's rotary tables, computed once in float32 (on the CPU, as HF does) for every position.
        d = spec.head_dim
        freqs = torch.arange(max_seq_len, dtype=torch.float)[:, None] * rope_inv_freq(spec)
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        self.cos = emb.cos().to(device, dtype)
        self.signed_sin = torch.cat((-sin[:, : d // 2], sin[:, d // 2 :]), dim=-1).to(
            device, dtype
        )  # rotate()
        # Row starts in a [rows * positions] view.
        self.row_slots = torch.arange(max_batch_size, device=device) * max_seq_len
        self.columns = torch.arange(max_seq_len * spec.num_kv_heads, device=device)
        # The kv head of each query head (GQA): query head h reads kv head h // (heads per kv head).
        self.query_group = torch.arange(spec.num_heads, device=device) // (
            spec.num_heads // spec.num_kv_heads
        )
        layers = weights.layers
        self._layout = _lora_layout(spec, intermediate_size=layers[0].down.shape[1] if layers else 0)
        self.lora_shapes = _lora_shapes(spec, intermediate_size=layers[0].down.shape[1] if layers else 0)
        self._lora = LoraStacks(list(self._layout), dtype, device)

    @classmethod
    def from_model(
        cls, model: Any, dtype: torch.dtype, max_batch_size: int, max_seq_len: int, device: torch.device
    ) -> Qwen2Runner:
        """A runner over a copy of an HF model's weights; UnsupportedModel if it is not one of ours."""
        spec = ModelSpec.from_hf_config(model.config, max_seq_len)
        with torch.inference_mode():
            weights = Weights.from_state_dict(model.state_dict(), spec, dtype, device)
            return cls(spec, weights, max_batch_size, max_seq_len, device)

    def snapshot(self, state_dict: dict[str, Tensor]) -> Weights:
        return Weights.from_state_dict(state_dict, self.spec, self.dtype, self.device)

    def install(self, weights: Weights) -> None:
        self.weights = weights  # one assignment: each pass reads `self.weights` once (see prefill, decode)

    def snapshot_adapter(self, modules: AdapterModules, scale: float) -> FusedAdapter:
        return FusedAdapter.build(modules, scale, self._layout, self.dtype, self.device)

    def prefill(
        self,
        prompts: list[list[int]],
        row0: int | None,
        adapters: Sequence[FusedAdapter | None],
        full_rows: Sequence[int] = (),
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """Logits [b, V] (float32) at each prompt's last token and [P, V] of the `full_rows`; writes KV rows
        row0.. (None: no cache)."""
        w = self.weights  # one snapshot for the whole pass
        b = len(prompts)
        lora = self._lora.batch(adapters)
        if row0 is None:  # no cache rows to write (full_logits): one right-padded batch
            t = max(len(p) for p in prompts)
            token_lora = None if lora is None else lora.per_token(t)
            h = self._prefill_hidden(w, prompts, token_lora)  # [b * t, hidden]
            starts = [i * t for i in range(b)]
        else:
            h, starts = self._packed_pass(w, prompts, [0] * b, row0, lora)
        last = torch.tensor(
            [start + len(p) - 1 for start, p in zip(starts, prompts, strict=True)], device=self.device
        )
        logits = self._logits(w, h[last], lora)
        full = {}
        for i in full_rows:
            n = len(prompts[i])
            row_lora = None if lora is None else lora.select(lora.mask[i : i + 1].expand(n, -1, -1))
            full[i] = self._logits(w, h[starts[i] : starts[i] + n], row_lora)
        return logits, full

    def fill_cache(
        self, prefixes: list[list[int]], row0: int, adapters: Sequence[FusedAdapter | None]
    ) -> None:
        """Recompute the K/V of rows row0.. from their token prefixes under the current weights (no logits).

        Positions past a row's prefix keep what they held; decode masks them and overwrites them in turn.
        """
        self._packed_pass(self.weights, prefixes, [0] * len(prefixes), row0, self._lora.batch(adapters))

    def _prefill_hidden(self, w: Weights, prompts: list[list[int]], lora: LoraBatch | None) -> Tensor:
        """Hidden states [b * t, hidden] of right-padded prompts, no cache (causality hides the pad keys)."""
        t = max(len(p) for p in prompts)
        ids = torch.tensor([p + [0] * (t - len(p)) for p in prompts], device=self.device)

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return causal_attention(q, k, v)

        return self._layers(w, ids, self.cos[:t], self.signed_sin[:t], attend, lora)

    def _packed_pass(
        self, w: Weights, prompts: list[list[int]], cached: Sequence[int], row0: int, lora: LoraBatch | None
    ) -> tuple[Tensor, list[int]]:
        """Computes positions cached[i].. of prompt i into cache row row0 + i (the first cached[i] are there
        already); returns their hidden states [N, hidden] (the rows' new tokens one after another) and the
        index at which each row's tokens begin.

        Packed, not padded: every matmul runs over the N new tokens only. A batch of prompts of unequal
        lengths (a multi-turn episode's later turns beside first turns) padded to the longest computed
        1.5x the tokens it needed in BlackJack's evaluation (`_packed_attention` says how rows attend)."""
        packed = self._packed_attention(prompts, cached, row0)
        token_lora = None if lora is None else lora.per_row_tokens(packed.lengths)
        positions = packed.positions
        h = self._layers(
            w, packed.ids[None], self.cos[positions], self.signed_sin[positions], packed.attend, token_lora
        )
        return h, packed.starts

    def _packed_attention(self, prompts: list[list[int]], cached: Sequence[int], row0: int) -> _Packed:
        """The new tokens of prompts whose first cached[i] positions are in cache row row0 + i, packed one
        row after another, and how they attend. Only attention sees rows: each row's queries are spread
        into a padded [b, t] layout. Rows that resume a cached prefix attend to the keys in their cache
        row, positions up to their own (an explicit mask); a pass of fresh prompts only attends causally
        over its own keys, spread the same way (`causal_attention`: no mask to build, and the flash
        kernel's memory for long prompts)."""
        dev = self.device
        news = [p[c:] for p, c in zip(prompts, cached, strict=True)]
        lengths = [len(n) for n in news]
        b, t, total = len(news), max(lengths), sum(lengths)
        starts = list(itertools.accumulate(lengths[:-1], initial=0))
        ids = torch.tensor([tok for n in news for tok in n], device=dev)  # [N]
        # Host lists -> tensors in one step each: token i of row r sits at position cached[r] + j.
        row_of = torch.repeat_interleave(torch.arange(b, device=dev), torch.tensor(lengths, device=dev))
        offset = torch.arange(total, device=dev) - torch.tensor(starts, device=dev)[row_of]  # j
        positions = torch.tensor(list(cached), device=dev)[row_of] + offset  # [N]
        slots = self.row_slots[row0 + row_of] + positions  # where the new K/V go in the flat cache
        padded = row_of * t + offset  # each token's place in the [b * t] layout
        nh, kv, d = self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim

        def spread(x: Tensor) -> Tensor:  # [1, N, heads, D] -> [b, t, heads, D], zeros where padding
            return x.new_zeros(b * t, *x.shape[2:]).index_copy_(0, padded, x[0]).view(b, t, *x.shape[2:])

        def store(layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
            """The new K/V into their cache slots; returns the layer's caches."""
            kc, vc = self.k_cache[layer], self.v_cache[layer]
            kc.view(-1, kv, d).index_copy_(0, slots, k[0])
            vc.view(-1, kv, d).index_copy_(0, slots, v[0])
            return kc, vc

        if not any(cached):

            def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
                store(layer, k, v)
                # Right padding: causality alone hides the pad keys from every real query.
                return causal_attention(spread(q), spread(k), spread(v)).index_select(0, padded)

        else:
            span = max(c + n for c, n in zip(cached, lengths, strict=True))
            # Padding queries (never read back) see position 0 only; real ones every key up to their own.
            query_positions = torch.zeros(b * t, dtype=torch.long, device=dev).index_copy_(
                0, padded, positions
            )
            visible = torch.arange(span, device=dev)[None, :] <= query_positions.view(b, t)[:, :, None]

            def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
                kc, vc = store(layer, k, v)
                keys, values = (c[row0 : row0 + b, :span].transpose(1, 2) for c in (kc, vc))  # [b, KV, S, D]
                out = F.scaled_dot_product_attention(
                    spread(q).transpose(1, 2), keys, values, attn_mask=visible[:, None], enable_gqa=True
                )  # [b, H, t, D]
                return out.transpose(1, 2).reshape(b * t, nh * d).index_select(0, padded)

        return _Packed(ids, positions, lengths, starts, attend)

    def prefill_after(
        self,
        prompts: list[list[int]],
        cached: Sequence[int],
        row0: int,
        adapters: Sequence[FusedAdapter | None],
    ) -> Tensor:
        """Logits [b, V] (float32) at each prompt's last token, computing only positions cached[i].. of
        prompt i: its new tokens attend to the K/V already in row row0 + i and to each other (causal)."""
        w = self.weights
        lora = self._lora.batch(adapters)
        h, starts = self._packed_pass(w, prompts, cached, row0, lora)
        ends = [start + len(p) - c for start, p, c in zip(starts, prompts, cached, strict=True)]
        return self._logits(w, h[torch.tensor(ends, device=self.device) - 1], lora)

    def full_logits(self, token_ids: list[int], adapter: FusedAdapter | None = None) -> Tensor:
        """Logits [T, V] (float32) at every position of one sequence; the cache is untouched."""
        _, full = self.prefill([token_ids], None, [adapter], full_rows=[0])
        return full[0]

    def decode(
        self, tokens: list[int], positions: list[int], adapters: Sequence[FusedAdapter | None]
    ) -> Tensor:
        """One token for each of rows 0..n-1 at its own position; returns logits [n, V] (float32)."""
        position = torch.tensor(positions, device=self.device)
        attend = self._decode_attention(positions, position)
        w = self.weights
        lora = self._lora.batch(adapters)
        ids = torch.tensor(tokens, device=self.device)[:, None]
        h = self._layers(w, ids, self.cos[position], self.signed_sin[position], attend, lora)
        return self._logits(w, h, lora)

    def decode_and_prefill(
        self,
        tokens: list[int],
        positions: list[int],
        prompts: list[list[int]],
        cached: Sequence[int],
        adapters: Sequence[FusedAdapter | None],
    ) -> Tensor:
        """`decode` for rows 0..n-1 and `prefill_after` for rows n.. (prompt i in row n + i, its first
        cached[i] positions there already; 0 for a fresh prompt) in one pass: logits [n + b, V] (float32),
        the decoded rows' then each prompt's at its last token. Every matmul, norm and LoRA runs once over
        all the pass's tokens, where two passes would each pay the per-op cost on the CPU (a continuous
        batch admits a few prompts beside its running rows at most steps); only attention splits, each
        part as its own pass computes it, so a row's numbers are the separate passes' up to float32
        rounding (a matmul over more rows may sum in another order: 3.6e-7 in logits, measured)."""
        n = len(tokens)
        position = torch.tensor(positions, device=self.device)
        decode_attend = self._decode_attention(positions, position)
        packed = self._packed_attention(prompts, cached, row0=n)

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            old = decode_attend(layer, q[:, :n], k[:, :n], v[:, :n])
            return torch.cat([old, packed.attend(layer, q[:, n:], k[:, n:], v[:, n:])])

        w = self.weights
        lora = self._lora.batch(adapters)
        token_lora = None if lora is None else lora.per_row_tokens([1] * n + packed.lengths)
        ids = torch.cat([torch.tensor(tokens, device=self.device), packed.ids])[None]
        every = torch.cat([position, packed.positions])
        h = self._layers(w, ids, self.cos[every], self.signed_sin[every], attend, token_lora)
        ends = [n + start + length - 1 for start, length in zip(packed.starts, packed.lengths, strict=True)]
        return self._logits(w, h[torch.tensor(list(range(n)) + ends, device=self.device)], lora)

    def _decode_attention(self, positions: list[int], position: Tensor) -> Attend:
        """How one new token of each of rows 0..n-1 (q [n or 1, 1 or n, H, D]) attends to its row's keys
        up to its own position, the token's K/V stored at that position first."""
        n, span = len(positions), max(positions) + 1  # the span from the host's list: no device sync
        nh, kv, d = self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim
        slots = self.row_slots[:n] + position
        # Each row's query heads attend over the keys of all its kv heads at once: one [H, span * KV] score
        # matrix per row (n batch entries in one bmm, not n * KV tiny ones: the masked columns cost less
        # than per-entry overhead). The bias hides the columns of other kv heads, and positions beyond the
        # row's own (stale or empty cache entries).
        column = self.columns[: span * kv]  # column c holds (position c // KV, kv head c % KV)
        hidden = (column % kv != self.query_group[:, None]) | (column // kv > position[:, None, None])
        bias = torch.zeros(hidden.shape, dtype=self.cos.dtype, device=self.device).masked_fill_(
            hidden, float("-inf")
        )

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            kc, vc = self.k_cache[layer], self.v_cache[layer]
            kc.view(-1, kv * d).index_copy_(0, slots, k.reshape(n, kv * d))
            vc.view(-1, kv * d).index_copy_(0, slots, v.reshape(n, kv * d))
            # Plain bmm: for one query token it beats SDPA's flash kernel.
            keys = kc[:n, :span].view(n, span * kv, d)
            scores = torch.baddbmm(bias, q.reshape(n, nh, d), keys.transpose(1, 2), alpha=d**-0.5)
            probs = scores.softmax(dim=-1, dtype=torch.float32).to(vc.dtype)  # float32, like HF's eager
            return torch.bmm(probs, vc[:n, :span].view(n, span * kv, d)).view(n, -1)

        return attend

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.kv_cache[:, :, dst, :length] = self.kv_cache[:, :, src, :length]

    def clear_row(self, row: int) -> None:
        self.kv_cache[:, :, row].zero_()

    def _layers(
        self, w: Weights, ids: Tensor, cos: Tensor, sin: Tensor, attend: Attend, lora: LoraBatch | None
    ) -> Tensor:
        """Embedding and decoder layers over ids [b, t] -> hidden [b * t, hidden] (2-D, so that residual
        adds fuse into addmm); cos/sin [t or b, D] broadcast to [b, t, 1, D]. `lora`: one mask row per token.
        """
        spec = self.spec
        b, t = ids.shape
        nh, nkv, d, eps = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rms_norm_eps
        cos, sin = cos.view(-1, t, 1, d), sin.view(-1, t, 1, d)
        x = F.embedding(ids.reshape(-1), w.embed)
        for i, lw in enumerate(w.layers):
            normed = rms_norm(x, lw.input_norm, eps)
            qkv_2d = F.linear(normed, lw.qkv, lw.qkv_bias)
            if lora is not None:
                lora.add_(qkv_2d, f"{i}.qkv", normed)
            qkv = qkv_2d.view(b, t, nh + 2 * nkv, d)
            qk, v = qkv.split([nh + nkv, nkv], dim=2)
            if lw.q_norm is not None and lw.k_norm is not None:
                q, k = qk.split([nh, nkv], dim=2)
                qk = torch.cat([rms_norm(q, lw.q_norm, eps), rms_norm(k, lw.k_norm, eps)], dim=2)
            q, k = rotate(qk, cos, sin).split([nh, nkv], dim=2)  # q and k heads rotated in one pass
            attended = attend(i, q, k, v)
            x = add_linear(x, attended, lw.o_proj, lw.o_bias)
            if lora is not None:
                lora.add_(x, f"{i}.o", attended)
            normed = rms_norm(x, lw.post_norm, eps)
            gate, up = gate_up_linear(normed, lw.gate_up, lora, f"{i}.gate_up")
            # In place into the gate half: no new activation buffers.
            activated = F.silu(gate, inplace=True).mul_(up)
            x = add_linear(x, activated, lw.down, None)
            if lora is not None:
                lora.add_(x, f"{i}.down", activated)
        return x

    def _logits(self, w: Weights, h: Tensor, lora: LoraBatch | None) -> Tensor:
        normed = rms_norm(h, w.norm, self.spec.rms_norm_eps)
        logits = F.linear(normed, w.lm_head)
        if lora is not None:
            lora.add_(logits, "lm_head", normed)
        return logits.float()


def _lora_layout(spec: ModelSpec, intermediate_size: int) -> dict[str, SiteParts]:
    """The fused matmuls LoRA modules land in: site -> (HF module, first output column, width)."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    layout: dict[str, SiteParts] = {}
    for i in range(spec.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        layout[f"{i}.qkv"] = [
            (attn + "q_proj", 0, q),
            (attn + "k_proj", q, kv),
            (attn + "v_proj", q + kv, kv),
        ]
        layout[f"{i}.o"] = [(attn + "o_proj", 0, spec.hidden_size)]
        layout[f"{i}.gate_up"] = [
            (mlp + "gate_proj", 0, intermediate_size),
            (mlp + "up_proj", intermediate_size, intermediate_size),
        ]
        layout[f"{i}.down"] = [(mlp + "down_proj", 0, spec.hidden_size)]
    layout["lm_head"] = [("lm_head", 0, spec.vocab_size)]
    return layout


def _lora_shapes(spec: ModelSpec, intermediate_size: int) -> dict[str, tuple[int, int]]:
    """HF module name -> (in, out) of every linear layer an adapter may target."""
    q, kv, hidden = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.hidden_size
    shapes = {"lm_head": (hidden, spec.vocab_size)}
    for i in range(spec.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        shapes |= {attn + "q_proj": (hidden, q), attn + "k_proj": (hidden, kv), attn + "v_proj": (hidden, kv)}
        shapes |= {attn + "o_proj": (q, hidden)}
        shapes |= {
            mlp + "gate_proj": (hidden, intermediate_size),
            mlp + "up_proj": (hidden, intermediate_size),
        }
        shapes |= {mlp + "down_proj": (intermediate_size, hidden)}
    return shapes
