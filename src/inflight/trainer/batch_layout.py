"""How a micro-batch's samples meet the model: the `MicroBatch` and its three layouts, and the probes that
check a model honours them.

- **Padded**: one right-padded row per sample (`input_ids`, `attention_mask`).
- **Packed**: samples end to end in rows as long as the longest sample, positions restarting at 0 and no
  attention mask, so transformers' packed-sequence masking keeps each sample to itself; nothing is spent
  on padding.
- **Packed with shared prefixes**: samples that begin with the same tokens (a GRPO group's samples share
  their prompt; BlackJack's 8 episodes of one hand share its ~40-token first turn) are laid out as one
  copy of the common prefix followed by each sample's own continuation (a branch), with an explicit
  [rows, 1, L, L] attention mask: a prefix token sees the prefix before it, a branch token the whole
  prefix and its own branch before it, positions continuing from the prefix. Every token's logits are
  those of its sample alone, and the backward pass sums each branch's gradient into the shared prefix,
  which is the sum the samples' separate passes give. `make run`'s batch: 5,379 tokens laid out as 1,286.

The loss always sees per-sample [B, T] tensors: `packed_flat` maps (b, t) to where that token was laid out
(in a shared prefix, several samples map to one place), and `select` gathers the forward's outputs there.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inflight.errors import describe
from inflight.trainer.micro_batches import PrefixGroup, pack_rows, shared_prefix_groups
from inflight.types import TrainSample

# A group laid out with its shared prefix is at most this many times as long as the longest sample: the
# rows' attention is dense over their length, so its cost per token grows with it.
SHARED_ROW_LENGTH_FACTOR = 2


@dataclass
class MicroBatch:
    """One forward/backward's tensors. The loss's are per sample, right-padded [B, T]: position t holds the
    target token t+1 of sample b. The forward pass's are the same padded rows (`input_ids`,
    `attention_mask`) or, packed, the packed rows (`packed_ids`, `packed_positions`, and with shared
    prefixes `packed_mask`), `packed_flat` saying where each (b, t) was laid out."""

    input_ids: torch.Tensor  # [B, T] tokens 0..T-1 of each sample (padded)
    attention_mask: torch.Tensor  # [B, T] 1 for real tokens
    targets: torch.Tensor  # [B, T] token t+1 (0 where padded)
    mask: torch.Tensor  # [B, T] loss weight of target t+1
    behaviour_logprobs: torch.Tensor  # [B, T]
    advantages: torch.Tensor  # [B, T]
    # [B, T] bool: target t+1 was sampled by weights of version `current_version` on a prefix those same
    # weights computed (its whole reply was); there, engine and trainer logprobs must agree exactly.
    current: torch.Tensor
    packed_ids: torch.Tensor | None = None  # [R, L] the laid-out input tokens, 0-padded at each row's end
    packed_positions: torch.Tensor | None = None  # [R, L] each token's position in its own sample
    packed_flat: torch.Tensor | None = None  # [B, T] index of input token (b, t) in packed_ids.view(-1)
    packed_mask: torch.Tensor | None = None  # [R, 1, L, L] bool, shared prefixes only: query row sees key

    @property
    def rows(self) -> int:
        """Rows of the forward pass (packed rows when packed)."""
        ids = self.packed_ids if self.packed_ids is not None else self.input_ids
        return int(ids.shape[0])

    @property
    def forward_tokens(self) -> int:
        """Real tokens the forward pass computes: a shared prefix once, padding not at all."""
        if self.packed_flat is None:
            return int(self.attention_mask.sum())
        return int(self.packed_flat[self.attention_mask.bool()].unique().numel())

    def to(self, device: torch.device) -> MicroBatch:
        """The same tensors on `device` (collated on the CPU, then one copy each)."""
        fields: dict[str, torch.Tensor | None] = {
            name: getattr(self, name) for name in self.__dataclass_fields__
        }
        return MicroBatch(
            **{name: t if t is None else t.to(device, non_blocking=True) for name, t in fields.items()}  # type: ignore[arg-type]
        )

    def forward_inputs(self) -> dict[str, torch.Tensor | bool | None]:
        """Keyword arguments of a Hugging Face forward over this micro-batch. Packed: no attention mask, so
        that the model finds each sample from the restarting positions (transformers' packed-sequence
        masking); with shared prefixes, the explicit 4D mask (transformers uses a 4D mask as given)."""
        if self.packed_ids is not None:
            inputs: dict[str, torch.Tensor | bool | None] = {
                "input_ids": self.packed_ids,
                "position_ids": self.packed_positions,
                "use_cache": False,
            }
            if self.packed_mask is not None:
                inputs["attention_mask"] = self.packed_mask
            return inputs
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "use_cache": False}

    def flat_positions(self, where: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The distinct indices into a forward output viewed as [rows * L, D] that `select(out, where)`
        reads (in a shared prefix, several samples read one)."""
        rows, cols = where
        if self.packed_flat is None:
            return torch.unique(rows * self.input_ids.shape[1] + cols)
        return torch.unique(self.packed_flat[rows, cols])

    def select(self, out: torch.Tensor, where: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """[N, D] rows of a forward output [rows, L, D] at the (b, t) positions `where`."""
        rows, cols = where
        if self.packed_flat is None:
            return out[rows, cols]
        return out.reshape(-1, out.shape[-1])[self.packed_flat[rows, cols]]

    @classmethod
    def collate(
        cls,
        samples: Sequence[TrainSample],
        pad_id: int = 0,
        current_version: int | None = None,
        pack: bool = False,
        share_prefixes: bool = False,
    ) -> MicroBatch:
        width = max(len(s.token_ids) for s in samples) - 1
        if width < 1:
            raise ValueError("every TrainSample needs at least 2 tokens (a context and a target)")

        def pad(rows: Sequence[Sequence[float]], dtype: torch.dtype, value: float = 0) -> torch.Tensor:
            # One tensor from padded lists: a copy per row costs more than the rows' values.
            return torch.tensor([[*row, *[value] * (width - len(row))] for row in rows], dtype=dtype)

        inputs = [s.token_ids[:-1] for s in samples]
        packed = {}
        if pack:
            if share_prefixes:
                groups = shared_prefix_groups(inputs, max_tokens=SHARED_ROW_LENGTH_FACTOR * width)
            else:
                groups = [PrefixGroup(members=(i,), shared=len(ids)) for i, ids in enumerate(inputs)]
            packed = _packed_layout(inputs, groups, pad_id)
        return cls(
            input_ids=pad(inputs, torch.long, pad_id),
            attention_mask=pad([[1] * (len(s.token_ids) - 1) for s in samples], torch.long),
            targets=pad([s.token_ids[1:] for s in samples], torch.long),
            mask=pad([s.loss_mask[1:] for s in samples], torch.float32),
            behaviour_logprobs=pad([s.behaviour_logprobs[1:] for s in samples], torch.float32),
            advantages=pad([s.advantages[1:] for s in samples], torch.float32),
            current=pad(
                [sampled_by(s.versions, s.loss_mask, current_version)[1:] for s in samples], torch.bool
            ),
            **packed,
        )


def _packed_layout(
    inputs: Sequence[Sequence[int]], groups: Sequence[PrefixGroup], pad_id: int
) -> dict[str, torch.Tensor]:
    """The packed tensors for `inputs` laid out as `groups`: each group its shared prefix once, then each
    member's branch; groups end to end in rows (first-fit decreasing). With no group of several members,
    no mask: positions restarting at 0 are the whole story (a row's unused tail counts up from 0 too, a
    sequence of its own attending to nothing real)."""
    lengths = [len(ids) for ids in inputs]
    group_lengths = [g.laid_out_length(lengths) for g in groups]
    width = max(group_lengths)
    rows = pack_rows(group_lengths, capacity=width)
    # Built as Python lists, then one tensor each: per-span tensor copies cost more than the tokens.
    ids: list[list[int]] = []
    positions: list[list[int]] = []
    segment: list[list[int]] = []  # which group a token belongs to; -1: the row's unused tail
    branch: list[list[int]] = []  # its member's branch; -1: the prefix (or the tail)
    flat = [[0] * max(lengths) for _ in inputs]
    for r, members in enumerate(rows):
        row_ids: list[int] = []
        row_positions: list[int] = []
        row_segment: list[int] = []
        row_branch: list[int] = []
        for g in members:
            group, shared = groups[g], groups[g].shared
            base = r * width + len(row_ids)
            prefix = range(base, base + shared)
            row_ids += inputs[group.members[0]][:shared]
            row_positions += range(shared)
            row_segment += [g] * shared
            row_branch += [-1] * shared
            for j, i in enumerate(group.members):
                n = lengths[i] - shared
                cursor = r * width + len(row_ids)
                flat[i][:shared] = prefix
                flat[i][shared : lengths[i]] = range(cursor, cursor + n)
                row_ids += inputs[i][shared:]
                row_positions += range(shared, lengths[i])
                row_segment += [g] * n
                row_branch += [j] * n
        tail = width - len(row_ids)
        ids.append(row_ids + [pad_id] * tail)
        positions.append(row_positions + list(range(tail)))
        segment.append(row_segment + [-1] * tail)
        branch.append(row_branch + [-1] * tail)
    out = {
        "packed_ids": torch.tensor(ids, dtype=torch.long),
        "packed_positions": torch.tensor(positions, dtype=torch.long),
        "packed_flat": torch.tensor(flat, dtype=torch.long),
    }
    if any(len(g.members) > 1 for g in groups):
        out["packed_mask"] = _shared_prefix_mask(
            torch.tensor(segment, dtype=torch.long), torch.tensor(branch, dtype=torch.long)
        )
    return out


def _shared_prefix_mask(segment: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """[R, 1, L, L] bool: query token q sees key k when k is not after q, both are of the same group, and k
    is in the prefix or in q's own branch. A row's padding (segment -1) sees only itself."""
    rows, width = segment.shape
    padding = segment < 0
    own = -2 - torch.arange(rows * width).view(rows, width)  # a group of its own for each padding token
    segment = torch.where(padding, own, segment)
    index = torch.arange(width)
    causal = index[None, :] <= index[:, None]  # [q, k]
    same_group = segment[:, :, None] == segment[:, None, :]
    visible = (branch[:, None, :] == -1) | (branch[:, None, :] == branch[:, :, None])
    return (causal[None] & same_group & visible)[:, None]


def sampled_by(versions: Sequence[int], loss_mask: Sequence[float], version: int | None) -> list[bool]:
    """Per token: trained, and its reply (a run of trained tokens) was sampled by `version` throughout.

    A reply starts with a prefill and its first token in one engine step, so an update between its
    tokens is the only way its KV prefix can come from other weights (`kv_policy=keep`); a reply all of
    one version has none. Multi-turn prompts are re-prefilled every turn.
    """
    out = [False] * len(versions)
    start = 0
    while start < len(versions):
        if not loss_mask[start]:
            start += 1
            continue
        end = start
        while end < len(versions) and loss_mask[end]:
            end += 1
        if version is not None and all(v == version for v in versions[start:end]):
            out[start:end] = [True] * (end - start)
        start = end
    return out


def packing_is_exact(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether `model` keeps packed sequences apart: two short sequences in one row (positions restarting,
    no attention mask) give the logits each gives alone. Warns (and the trainer pads) where they do not,
    e.g. a model whose attention ignores `position_ids`."""
    return _layout_is_exact(
        model,
        device,
        prefix=[],
        share_prefixes=False,
        fallback="training pads instead (trainer.packing=false silences this)",
        problem="mixes packed sequences (its attention does not restart at position 0)",
    )


def sliding_window(config: object) -> int | None:
    """The window (tokens) of the model's sliding-window attention layers, or None when every layer attends
    over the whole sequence. The shared-prefix layout's 4D mask (`_shared_prefix_mask`) is used as given by
    every layer, so it cannot slide: the trainer shares prefixes only in micro-batches whose sequences all
    fit in the window (where the window changes nothing). Packing without sharing is exact either way:
    Hugging Face's mask slides over a packed row's positions, which restart per sequence.
    Mistral: `sliding_window` on every layer when set; Qwen2/Qwen3: `layer_types` says which layers slide
    (none unless `use_sliding_window`)."""
    window = getattr(config, "sliding_window", None)
    layer_types = set(getattr(config, "layer_types", None) or [])
    sliding_off = getattr(config, "use_sliding_window", None) is False
    if window is None or sliding_off or layer_types == {"full_attention"}:
        return None
    return int(window)


def shared_prefixes_are_exact(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether `model` honours the shared-prefix layout: two sequences that begin alike, laid out as one
    prefix and two branches under a 4D attention mask, give the logits each gives alone. Warns (and the
    trainer packs without sharing) where they do not, e.g. a model that ignores a 4D attention mask."""
    return _layout_is_exact(
        model,
        device,
        prefix=[3, 4, 5, 6],
        share_prefixes=True,
        fallback="training packs without sharing prefixes (trainer.share_prefixes=false silences this)",
        problem="does not honour a 4D attention mask (shared prefixes)",
    )


def _layout_is_exact(
    model: torch.nn.Module,
    device: torch.device,
    prefix: list[int],
    share_prefixes: bool,
    fallback: str,
    problem: str,
) -> bool:
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 2)
    generator = torch.Generator().manual_seed(0)
    seqs = [
        [t % vocab for t in prefix] + torch.randint(1, vocab, (n,), generator=generator).tolist()
        for n in (3, 4, 7)  # packed, the 3 and the 4 share a row
    ]
    samples = [
        TrainSample(
            token_ids=[*s, 0],
            loss_mask=[0.0] * (len(s) + 1),
            behaviour_logprobs=[0.0] * (len(s) + 1),
            advantages=[0.0] * (len(s) + 1),
            versions=[-1] * (len(s) + 1),
        )
        for s in seqs
    ]
    mb = MicroBatch.collate(samples, pack=True, share_prefixes=share_prefixes).to(device)
    assert mb.rows < len(seqs), "the probe must lay several sequences out in one row"
    rows, cols = mb.attention_mask.nonzero(as_tuple=True)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            alone = [
                model(input_ids=torch.tensor(s, device=device)[None], use_cache=False).logits[0].float()
                for s in seqs
            ]
            laid_out = mb.select(model(**mb.forward_inputs()).logits, (rows, cols)).float()
    except Exception as e:  # a model whose forward takes no position_ids or 4D mask
        name = type(model).__name__
        warnings.warn(f"{name} cannot run this layout ({describe(e)}): {fallback}", stacklevel=3)
        return False
    finally:
        model.train(was_training)
    exact = torch.allclose(
        torch.cat(alone), laid_out, rtol=1e-3, atol=1e-3 * float(torch.cat(alone).abs().max())
    )
    if not exact:
        warnings.warn(f"{type(model).__name__} {problem}: {fallback}", stacklevel=3)
    return exact
