"""Data-parallel training of the pipeline Trainer over torch.distributed (gloo on CPU, NCCL on CUDA): every
rank holds the whole policy (full or LoRA) and trains on its token-balanced share of each step; the ranks'
gradients are summed, and every rank then runs the same optimizer step on the same gradients.

Knows process groups, not processes: a launcher starts the ranks, calls `init_data_parallel` in each, and
hands every rank the same whole step. The loss, micro-batching and what trains stay `trainer.py`'s.

One step, on each of W ranks (every arrow into a box is a collective every rank joins):

    samples of the whole step (the same on every rank, in the same order)
      │ shard_by_tokens (pure, so every rank agrees): this rank's share, longest first onto the emptiest rank
      ▼
    all_gather [tokens, sequences, samples, batch fingerprint] ──▶ StepCounts of the whole step
      │                                                           (and a check that the batches agree)
      ▼
    Trainer._accumulate(share, whole-step counts): micro-batches, backward; gradients stay local
      ▼
    all_gather_object(PartialMetrics) ──▶ the step's metrics, merged in rank order: the same on every rank
      ▼
    optim_step: all_reduce(SUM) of the trained parameters' gradients in flat buckets ──▶ AdamW, version + 1
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from inflight.models.device import resolve_device
from inflight.trainer.config import TrainerConfig
from inflight.trainer.lora_policy import LoraPolicy
from inflight.trainer.micro_batches import shard_by_tokens
from inflight.trainer.trainer import PartialMetrics, StepCounts, Trainer, through_last_trained
from inflight.types import TrainSample

# DDP's default (bucket_cap_mb=25): large enough that a collective's latency is paid rarely, small enough
# that the flat copy of a bucket costs little memory.
GRADIENT_BUCKET_BYTES = 25 * 2**20


def backend_for(device: torch.device) -> str:
    """The torch.distributed backend for a trainer on `device`: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def tcp_rendezvous(
    host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0
) -> dist.TCPStore:
    """The store the ranks meet at over TCP, to pass to `init_data_parallel` in place of an init method:
    rank 0 listens on `host:port`, the others connect to it. Port 0 makes rank 0 listen on a port the OS
    assigns, read back as `.port` and handed to the other ranks. That leaves no window between choosing a
    port and listening on it: a launcher that probes a free port and has torch bind it later loses it now
    and then to another process on the node (torch's "EADDRINUSE" as the run starts)."""
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def init_data_parallel(
    rank: int,
    world_size: int,
    init_method: str | dist.Store,
    device: str = "cpu",
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """Join the default process group as `rank` of `world_size`, on the backend `device` asks for; returns
    the group a `DataParallelTrainer` takes. Every rank calls it; it returns once all have joined.

    `init_method`: rank 0's "tcp://HOST:PORT", a "file://" path all ranks see, "env://" (MASTER_ADDR,
    MASTER_PORT), or each rank's `tcp_rendezvous` store (every rank then passes one). `device` is the
    rank's `trainer.device`: on CUDA each rank takes its own, which becomes the current device (NCCL and
    the collectives of Python objects use it): `cuda:N` as given, a bare `cuda` (or `auto`) the
    node-local rank's (`LOCAL_RANK`, as torchrun and Ray set it, else `rank` modulo the devices this node
    has). `timeout_s` bounds joining and every later collective, so a rank that dies or hangs fails the
    others instead of stalling them.
    """
    resolved = resolve_device(device, "trainer.device")
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised in this process: pass its group to "
            "DataParallelTrainer instead of calling init_data_parallel again"
        )
    if resolved.type == "cuda":
        if resolved.index is None:
            local_rank = int(os.environ.get("LOCAL_RANK", rank))
            resolved = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(resolved)
    meet = {"store": init_method} if isinstance(init_method, dist.Store) else {"init_method": init_method}
    dist.init_process_group(
        backend_for(resolved),
        **meet,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    group = dist.group.WORLD
    assert group is not None  # just initialised
    return group


def _buckets(tensors: Sequence[Tensor], bucket_bytes: int) -> list[list[Tensor]]:
    """`tensors` in order, grouped by dtype into buckets of at most `bucket_bytes` (a larger tensor alone)."""
    buckets: list[list[Tensor]] = []
    sizes: list[int] = []  # bytes in each bucket
    open_bucket: dict[torch.dtype, int] = {}  # the bucket each dtype is filling
    for t in tensors:
        size = t.numel() * t.element_size()
        i = open_bucket.get(t.dtype)
        if i is None or sizes[i] + size > bucket_bytes:
            i = open_bucket[t.dtype] = len(buckets)
            buckets.append([])
            sizes.append(0)
        buckets[i].append(t)
        sizes[i] += size
    return buckets


def all_reduce_gradients(
    params: Sequence[Tensor], group: dist.ProcessGroup | None, bucket_bytes: int = GRADIENT_BUCKET_BYTES
) -> None:
    """Sum every parameter's gradient over the ranks of `group`, in place, one collective per flat bucket
    (per dtype) rather than one per tensor. A parameter without a gradient on some rank (e.g. a rank whose
    share was empty) contributes zeros; one without a gradient on every rank keeps none, as it would in one
    process (AdamW skips it rather than decaying it)."""
    if not params:
        return
    has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
    dist.all_reduce(has_grad, op=dist.ReduceOp.MAX, group=group)
    grads: list[Tensor] = []
    for p, flag in zip(params, has_grad.tolist(), strict=True):
        if not flag:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    for bucket in _buckets(grads, bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


class DataParallelTrainer(Trainer):
    """One rank of a data-parallel `Trainer`. `train_step(samples)` takes the WHOLE step's samples, the
    same on every rank in the same order (checked), and trains on this rank's token-balanced share, with
    the loss reduced by the whole step's denominators, so W ranks make the update one Trainer makes on
    the whole batch (up to float rounding; `tests/test_trainer_distributed.py`). `forward_backward`,
    `optim_step` and `train_step` are collectives: every rank calls them, in the same order. Their metrics
    are the whole step's and the same on every rank, plus `dp_token_imbalance` (the fullest rank's
    tokens over the mean: 1 is a perfect split).

    Gradients are summed by an explicit all-reduce of the trained parameters' gradients before each
    optimizer step, not by DDP, because:
      - the LoRA policy's trained tensors live in its adapter set and reach the forward pass through the
        router, not as the module's parameters, which are all DDP hooks;
      - the trainer runs the decoder and the LM head as two calls (`Trainer._trained_logits`), never the
        wrapped module's forward, where DDP prepares each backward's reduction;
      - ranks run different numbers of micro-batches (their own token budget, micro-batches with nothing
        trained skipped, an empty share when a step has fewer samples than ranks), while DDP needs the same
        number of synchronised backward passes everywhere;
      - each rank's loss is already divided by the whole step's denominators, so the right reduction is a
        sum; DDP averages.
    What this gives up is DDP's overlap of the reduction with the backward pass; under gradient
    accumulation DDP reduces during the last micro-batch only, so at most one micro-batch's backward of
    overlap. Gradients accumulated by several `forward_backward` calls are reduced once, in `optim_step`.

    Every rank holds the same weights and optimizer state (checked at construction: every rank must load
    the same checkpoint and LoRA seed; `assert_replicas_in_sync` checks again on demand), so rank 0
    alone writes checkpoints and publishes weights (`is_writer`).
    """

    def __init__(
        self,
        model: nn.Module,
        config: TrainerConfig,
        group: dist.ProcessGroup | None = None,
        pad_id: int = 0,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "DataParallelTrainer needs torch.distributed: call init_data_parallel(rank, world_size, "
                "init_method) in every rank first"
            )
        super().__init__(model, config, pad_id)
        self.group = group  # None: the default group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.assert_replicas_in_sync()

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes checkpoints and publishes weights (rank 0; the others hold copies)."""
        return self.rank == 0

    def forward_backward(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        lengths = [len(through_last_trained(s).token_ids) - 1 for s in samples]  # the tokens each computes
        mine = shard_by_tokens(lengths, self.world_size)[self.rank]
        share = [samples[i] for i in mine]
        counts, imbalance = self._whole_step_counts(samples, share, lengths, sum(lengths[i] for i in mine))
        partial = self._accumulate(share, counts)
        metrics = self._step_metrics(self._merged(partial), counts)
        metrics["dp_token_imbalance"] = imbalance
        return metrics

    def optim_step(self) -> dict[str, float]:
        all_reduce_gradients(self._replicated_parameters(), self.group)
        return super().optim_step()

    def _replicated_parameters(self) -> list[Tensor]:
        """The trained tensors every rank holds whole, whose gradients `optim_step` sums over the ranks."""
        return self.policy.parameters()

    def _whole_step_counts(
        self,
        samples: Sequence[TrainSample],
        share: Sequence[TrainSample],
        lengths: Sequence[int],
        share_tokens: int,
    ) -> tuple[StepCounts, float]:
        """The whole step's counts (every rank's share summed) and the token imbalance, from one gather that
        also compares the ranks' batches: a rank handed another step would train on a wrong split."""
        own = StepCounts.of(share)
        batch = [float(len(samples)), float(sum(lengths)), float(sum(sum(s.token_ids) for s in samples))]
        row = torch.tensor(
            [own.num_tokens, own.num_sequences, own.num_samples, float(share_tokens), *batch],
            dtype=torch.float64,
            device=self.device,
        )
        rows = [torch.empty_like(row) for _ in range(self.world_size)]
        dist.all_gather(rows, row, group=self.group)
        table = torch.stack(rows).cpu()  # [W, 7], the same on every rank
        if not (table[:, 4:] == table[0, 4:]).all():
            raise RuntimeError(
                "data-parallel ranks were handed different steps (samples, tokens, token-id sums per rank: "
                f"{table[:, 4:].tolist()}): every rank must get the whole step's samples, in the same order"
            )
        total = table[:, :4].sum(dim=0).tolist()
        tokens = table[:, 3]
        imbalance = float(tokens.max() / tokens.mean()) if float(tokens.sum()) else 1.0
        return StepCounts(num_tokens=total[0], num_sequences=total[1], num_samples=total[2]), imbalance

    def _merged(self, partial: PartialMetrics) -> PartialMetrics:
        """Every rank's partial metrics merged in rank order (the same result on every rank)."""
        ratios = [torch.cat(partial.log_ratios).cpu()] if partial.log_ratios else []
        local = PartialMetrics(
            sums=partial.sums,
            extrema=partial.extrema,
            log_ratios=ratios,
            forward_tokens=partial.forward_tokens,
        )
        gathered: list[PartialMetrics | None] = [None] * self.world_size
        dist.all_gather_object(gathered, local, group=self.group)
        merged = PartialMetrics()
        for other in gathered:
            assert other is not None  # all_gather_object fills every slot
            merged.merge(other)
        return merged

    def _replica_tensors(self) -> dict[str, Tensor]:
        """What must be equal on every rank: the model's state (the base under LoRA) and the adapter."""
        tensors = dict(self.model.state_dict())
        if isinstance(self.policy, LoraPolicy):
            tensors.update(self.policy.adapter_update(self.version).tensors)
        return tensors

    def assert_replicas_in_sync(self) -> None:
        """RuntimeError naming the tensors that differ between ranks (`assert_same_on_every_rank` over the
        model's state and the LoRA adapter). A collective: every rank calls it."""
        assert_same_on_every_rank(self._replica_tensors(), self.group, self.device, self.version)


@torch.no_grad()
def assert_same_on_every_rank(
    tensors: Mapping[str, Tensor], group: dist.ProcessGroup | None, device: torch.device, version: int
) -> None:
    """RuntimeError naming the tensors whose float64 sum or sum of squares differs between ranks: a cheap
    fingerprint (one pass over the weights, one all-reduce of two numbers per tensor, on `device`) that
    catches ranks started from different weights or drifted apart. A collective: every rank calls it with
    the same names (none: nothing to compare, no collective)."""
    if not tensors:
        return
    per_tensor = [torch.stack([t.double().sum(), t.double().square().sum()]) for t in tensors.values()]
    fingerprint = torch.stack(per_tensor).to(device)  # [n, 2]
    extremes = torch.cat([fingerprint, -fingerprint])  # max of both: the largest and minus the smallest
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    n = len(per_tensor)
    differ = (extremes[:n] != -extremes[n:]).any(dim=1).tolist()
    names = [name for name, bad in zip(tensors, differ, strict=True) if bad]
    if names:
        raise RuntimeError(
            f"data-parallel ranks hold different weights ({len(names)} of {n} tensors differ, e.g. "
            f"{names[:3]}) at version {version}: every rank must load the same checkpoint and "
            "LoRA seed, and take the same steps"
        )
