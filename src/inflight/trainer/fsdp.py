"""Sharded data-parallel training (FSDP2, `torch.distributed.fsdp.fully_shard`): the data-parallel trainer
of `distributed.py`, but each rank holds 1/W of every weight, gradient and AdamW moment, gathering a unit's
weights only while it computes. For full-parameter training of a model whose training state (weights,
gradients and two AdamW moments) does not fit one device. Each rank still loads the whole model on the CPU
before sharding it (no loading of shards straight from the files).

Knows FSDP units and DTensors. The split of a step across ranks, the whole step's counts and the merged
metrics stay `distributed.py`'s; the loss and micro-batching `trainer.py`'s; the file layout of a checkpoint
`checkpoint.py`'s (the same files as one trainer's, holding full tensors).

One step, on each of W ranks (as in `distributed.py`, but for the passes and the optimizer):

    this rank's share ──▶ micro-batches ──▶ padded with idle passes to the most any rank runs
      │ every pass: all_gather each unit's weights (forward, and again in backward), then
      │ reduce_scatter(SUM) of its gradients: this rank's shard of the whole step's gradient
      ▼
    optim_step: the norm over all shards (one all-reduce), clip, AdamW on this rank's shards, version + 1
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from inflight.errors import UserError
from inflight.models.device import resolve_device
from inflight.trainer.batch_layout import MicroBatch
from inflight.trainer.config import TrainerConfig
from inflight.trainer.distributed import DataParallelTrainer, assert_same_on_every_rank
from inflight.trainer.policy import MODEL_CONFIG, OPTIMIZER, WEIGHTS, FullPolicy
from inflight.trainer.trainer import PartialMetrics, StepCounts, through_last_trained
from inflight.types import TrainSample


def shard_model(model: nn.Module, mesh: DeviceMesh) -> list[FSDPModule]:
    """Make `model`'s FSDP units, bottom-up, and return them: each decoder layer, the output embeddings
    (grouped with the input embeddings when the two are tied: one weight must live in one unit), then the
    decoder (what is left: the input embeddings, the final norm). The LM head is a unit of its own because
    the trainer calls the decoder and the head separately, never the root's forward.

    Every unit reshards after its forward (a root would otherwise keep its weights gathered until a
    backward that a no-grad forward never runs) and reduces its gradients as a plain SUM: each rank's loss
    is already divided by the whole step's denominators, so the sum is the whole step's gradient."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()  # type: ignore[operator]
    embed = model.get_input_embeddings()  # type: ignore[operator]
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in decoder.modules() if type(m).__name__ in layer_classes] if decoder else []
    if head is None or not layers:
        raise UserError(
            f"{type(model).__name__} is not a Hugging Face decoder (get_decoder() with layers named in "
            "_no_split_modules) with an LM head (get_output_embeddings()): it cannot be sharded here; train "
            "it with DataParallelTrainer"
        )
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    tied = head.weight is embed.weight
    fully_shard([embed, head] if tied else head, mesh=mesh, reshard_after_forward=True)
    fully_shard(decoder, mesh=mesh, reshard_after_forward=True)
    units: list[FSDPModule] = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # SUM, not PREMUL_SUM(1), which gloo lacks
    return units


def full_tensors(state: Mapping[str, Tensor], keep: bool) -> dict[str, Tensor]:
    """`state` with every DTensor gathered whole, copied to the CPU where `keep`, else {} (a rank that only
    joins the gathers). A collective, one all-gather per DTensor in `state`'s order: every rank calls it
    with the same keys. One full tensor at a time is on the device; the whole state only on the CPU."""
    out = {}
    for name, t in state.items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if keep:
            out[name] = full.detach().cpu()
    return out


def shard_like(full: Tensor, like: Tensor) -> Tensor:
    """This rank's shard of `full` placed as `like` (a DTensor: cut locally, no communication; every rank
    holds `full`), or `full` on `like`'s device when `like` is a plain tensor."""
    full = full.to(like.device, like.dtype)
    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


class ShardedFullPolicy(FullPolicy):
    """Every parameter trains, each a DTensor sharded by FSDP2 (dim 0 across the ranks); AdamW's moments
    are sharded alike, and its step runs on the local shards (the gradient norm, a DTensor, sums the
    shards' squares over the ranks). What leaves the policy is whole: `weights()` and `save()` gather
    the shards to the writer's CPU (collectives: every rank calls `weights()`, and a non-writer calls
    `full_state()` for the writer's `save()`); `load()` reads the full files on every rank and keeps its
    own shards. No frozen reference copy (the trainer refuses a KL penalty)."""

    def __init__(self, model: nn.Module, writer: bool) -> None:
        super().__init__(model, keep_reference=False)
        self.writer = writer
        not_sharded = [
            n for n, p in model.named_parameters() if p.requires_grad and not isinstance(p, DTensor)
        ]
        if not_sharded:
            raise RuntimeError(f"parameters outside every FSDP unit (or gathered): {not_sharded[:3]}")

    def weights(self) -> dict[str, Tensor]:
        """The full weights on the writer's CPU; {} on the other ranks. A collective."""
        return full_tensors(self.model.state_dict(), self.writer)

    def full_state(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The full weights and AdamW state (`optimizer.state_dict()`'s layout, as one trainer saves it) on
        the writer's CPU; empty on the other ranks. A collective."""
        weights = self.weights()
        optimizer = self.optimizer.state_dict()
        optimizer["state"] = {i: full_tensors(s, self.writer) for i, s in sorted(optimizer["state"].items())}
        return weights, optimizer

    def save(self, directory: Path) -> list[str]:
        """FullPolicy's files with full tensors, written by the writer while every other rank calls
        `full_state()` (the same gathers)."""
        weights, optimizer = self.full_state()
        save_file(weights, str(directory / WEIGHTS), metadata={"format": "pt"})
        self.model.config.to_json_file(str(directory / MODEL_CONFIG))  # type: ignore[union-attr,operator]
        torch.save(optimizer, directory / OPTIMIZER)
        return [WEIGHTS, MODEL_CONFIG, OPTIMIZER]

    @torch.no_grad()
    def load(self, directory: Path, load_optimizer: bool) -> None:
        weights = load_file(str(directory / WEIGHTS))
        optimizer = torch.load(directory / OPTIMIZER, weights_only=True) if load_optimizer else None
        state = self.model.state_dict(keep_vars=True)
        # A tied LM head may be left out (FullPolicy.load's rule): it is the input embeddings' weight.
        missing = [k for k in state if k not in weights and not k.endswith("lm_head.weight")]
        unexpected = [k for k in weights if k not in state]
        if missing or unexpected:
            raise UserError(
                f"checkpoint {directory} does not match the model: missing={missing} unexpected={unexpected}"
            )
        for name, t in state.items():
            if name in weights:
                t.copy_(shard_like(weights[name], t))
        if optimizer is not None:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            # Per-element state (AdamW's moments) is sharded as its parameter; `step` stays a plain scalar.
            for i, s in optimizer["state"].items():
                s.update({k: shard_like(v, params[i]) for k, v in s.items() if v.shape == params[i].shape})
            self.optimizer.load_state_dict(optimizer)


class ShardedDataParallelTrainer(DataParallelTrainer):
    """One rank of a data-parallel `Trainer` whose weights, gradients and AdamW state are sharded by FSDP2
    (`fully_shard`: see `shard_model` for the units). Takes the whole step on every rank and trains on this
    rank's share, as `DataParallelTrainer` does (the same split, whole-step denominators and merged
    metrics), and makes the update one Trainer makes on the whole batch, up to float rounding
    (`tests/test_trainer_fsdp.py`). `model` is the whole model, the same on every rank (checked), best on
    the CPU: sharding moves one unit at a time to the device and keeps its shard there
    (`init_data_parallel` made `trainer.device` the current device).

    FSDP gathers weights inside every forward and reduces gradients inside every backward, so every rank
    must run the same number of passes: a rank with fewer micro-batches than another (a shorter share, an
    empty one) runs idle passes, forward and backward of a zero loss over one token, which add nothing.
    Gradients are reduce-scattered after every micro-batch (no accumulation unsharded: that would hold a
    whole gradient per rank).

    Collectives (every rank calls them, in the same order): `forward_backward`, `optim_step`,
    `train_step`, `weights()` (and `base_weights()`, the same here), `save_checkpoint` and
    `resume_checkpoint`. `weights()` is whole on the writer's CPU and {} elsewhere; checkpoints are one
    trainer's files (full tensors, written by rank 0), so a run may resume sharded or not.

    Full-parameter only: a LoRA adapter is a few MB, trained replicated by `DataParallelTrainer`; sharding
    its frozen base (for a base too large for one device) needs the merged `weights()`/`base_weights()`
    gathered, not built. No KL penalty: its reference would be an unsharded copy of the model.
    """

    def __init__(
        self,
        model: nn.Module,
        config: TrainerConfig,
        group: dist.ProcessGroup | None = None,
        pad_id: int = 0,
    ) -> None:
        if config.lora_rank:
            raise UserError(
                "trainer.lora_rank > 0 with sharded weights: a LoRA adapter is small enough to train "
                "replicated; use DataParallelTrainer (sharding the frozen base is not built)"
            )
        if config.loss.kl_coef > 0:
            raise UserError(
                "trainer.loss.kl_coef > 0 with sharded weights: the KL reference would be an unsharded "
                "copy of the model; set kl_coef=0, or train unsharded"
            )
        if not dist.is_initialized():
            raise RuntimeError(
                "ShardedDataParallelTrainer needs torch.distributed: call init_data_parallel(rank, "
                "world_size, init_method, device) in every rank first"
            )
        device = resolve_device(config.device, "trainer.device")
        if device.type == "cuda" and device.index not in (None, torch.cuda.current_device()):
            raise UserError(
                f"trainer.device={config.device} is not the current CUDA device (cuda:"
                f"{torch.cuda.current_device()}), where FSDP puts the shards: pass the same device to "
                "init_data_parallel"
            )
        # Checked before sharding: afterwards each rank holds only its own shards, a silent mixture of
        # whatever each rank loaded.
        assert_same_on_every_rank(model.state_dict(), group, device, version=0)
        mesh_group = group if group is not None else dist.group.WORLD
        assert mesh_group is not None  # initialised above
        shard_model(model, DeviceMesh.from_group(mesh_group, device.type))
        super().__init__(model, config, group, pad_id)
        self.policy = ShardedFullPolicy(self.model, self.is_writer)  # AdamW over the sharded parameters

    def _accumulate(self, samples: Sequence[TrainSample], counts: StepCounts) -> PartialMetrics:
        """Trainer._accumulate over this rank's share, then idle passes up to the most passes any rank runs
        (counted the way `_accumulate` runs them: micro-batches with a trained token)."""
        groups = self._micro_batches([through_last_trained(s) for s in samples])
        passes = sum(1 for group in groups if any(w for s in group for w in s.loss_mask[1:]))
        most = torch.tensor([passes], device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
        partial = super()._accumulate(samples, counts)
        for _ in range(int(most) - passes):
            self._idle_pass()
        return partial

    def _idle_pass(self) -> None:
        """A forward and backward through the modules a micro-batch runs (so through every unit's
        all-gathers and reduce-scatters), of a zero loss: every gradient it adds is zero."""
        sample = TrainSample(
            token_ids=[self.pad_id, self.pad_id],
            loss_mask=[0.0, 1.0],
            behaviour_logprobs=[0.0, 0.0],
            advantages=[0.0, 0.0],
            versions=[-1, self.version],
        )
        cpu_mb = MicroBatch.collate(
            [sample], self.pad_id, pack=self.packing, share_prefixes=self.share_prefixes
        )
        mb = cpu_mb.to(self.device)
        where = tuple(i.to(self.device) for i in cpu_mb.mask.nonzero(as_tuple=True))
        with self.policy.routing(mb.rows):
            logits = self._trained_logits(self.model, mb, where, self.policy.routing)
            (logits.sum() * 0.0).backward()

    def _replicated_parameters(self) -> list[Tensor]:
        # FSDP has already summed the sharded gradients (reduce-scatter) during backward.
        return [p for p in self.policy.parameters() if not isinstance(p, DTensor)]

    def _replica_tensors(self) -> dict[str, Tensor]:
        """What every rank holds whole: the model's buffers (FSDP shards parameters only)."""
        return {k: v for k, v in self.model.state_dict().items() if not isinstance(v, DTensor)}

    def save_checkpoint(self, path: str | Path, extra: dict | None = None) -> Path:
        """Full weights, optimizer and version to `path` (`checkpoint.py`'s files, as one trainer writes
        them), written by rank 0 from every rank's shards. A collective: it returns on every rank once the
        checkpoint is complete."""
        if self.is_writer:
            saved = super().save_checkpoint(path, extra)  # the policy's save gathers, with the ranks below
        else:
            assert isinstance(self.policy, ShardedFullPolicy)
            self.policy.full_state()  # this rank's side of the writer's gathers
            saved = Path(path)
        dist.barrier(group=self.group)
        return saved

    def resume_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Every rank reads the full files at `path` (all must see them) and keeps its shards; a
        RuntimeError when the ranks resumed different versions."""
        meta = super().resume_checkpoint(path)
        versions = torch.tensor([self.version, -self.version], device=self.device)
        dist.all_reduce(versions, op=dist.ReduceOp.MAX, group=self.group)
        if int(versions[0]) != -int(versions[1]):
            raise RuntimeError(
                f"sharded ranks resumed different versions from {path} (this rank: {self.version}, "
                f"the latest: {int(versions[0])}): every rank must see the same checkpoint directory"
            )
        return meta
