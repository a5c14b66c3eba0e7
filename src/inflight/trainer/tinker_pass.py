"""Tinker's forward_backward over an adapter set: one batched forward(/backward) over the jobs of one base
model, whatever adapter each job uses.

Datums of all jobs are cut into micro-batches of at most `max_batch_tokens` padded tokens
(`micro_batches.pack_by_tokens`); every micro-batch runs the model once with a per-row adapter plan,
computes the Tinker loss of each job's rows (one call per loss and parameters) and back-propagates the sum
of the training jobs' losses. Losses are sums, so micro-batching is exact gradient accumulation. Knows
nothing of adapters' optimizers, requests or files.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from inflight.losses import LossParams, token_logprobs
from inflight.models.lora import LoraPlan, LoraRouter
from inflight.models.lora_adapter import LoraAdapter
from inflight.trainer.micro_batches import pack_by_tokens
from inflight.trainer.tinker_losses import PreparedJob, job_metrics, loss_outputs
from inflight.trainer.types import ForwardBackwardOutput

_ROW_KEYS = ("weights", "behaviour_logprobs", "advantages")


@dataclass
class FbWork:
    """A validated job and the slot of its adapter in the group's plan."""

    prepared: PreparedJob
    slot: int


def run_forward_backward(
    model: nn.Module,
    router: LoraRouter,
    slots: Sequence[LoraAdapter | None],
    work: Sequence[FbWork],
    max_batch_tokens: int,
    device: torch.device,
) -> list[ForwardBackwardOutput]:
    """Outputs per job, in order; gradients of jobs with `backward` accumulate into their adapters."""
    rows = [(w, d) for w, item in enumerate(work) for d in range(len(item.prepared.datums))]
    lengths = [work[w].prepared.datums[d].length for w, d in rows]
    logprobs: dict[tuple[int, int], Tensor] = {}
    losses: dict[tuple[int, int], Tensor] = {}
    for batch in pack_by_tokens(lengths, max_batch_tokens):
        # Rows of one adapter side by side: the LoRA layers then run one matmul pair per adapter.
        batch_rows = sorted((rows[i] for i in batch), key=lambda row: work[row[0]].slot)
        lp, per_token = _run_micro_batch(model, router, slots, work, batch_rows, device)
        for i, (w, d) in enumerate(batch_rows):
            n = work[w].prepared.datums[d].length
            logprobs[w, d], losses[w, d] = lp[i, :n], per_token[i, :n]
    outputs = []
    for w, item in enumerate(work):
        keys = [(w, d) for d in range(len(item.prepared.datums))]
        outputs.append(
            ForwardBackwardOutput(
                loss_fn_outputs=[
                    {"logprobs": logprobs[k].tolist(), "elementwise_loss": losses[k].tolist()} for k in keys
                ],
                metrics=job_metrics(item.prepared, [logprobs[k] for k in keys], [losses[k] for k in keys]),
            )
        )
    return outputs


def _run_micro_batch(
    model: nn.Module,
    router: LoraRouter,
    slots: Sequence[LoraAdapter | None],
    work: Sequence[FbWork],
    batch_rows: Sequence[tuple[int, int]],
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """Detached CPU log-probs and per-token losses [b,T] of the rows; backward of the training jobs' sum."""
    datums = [work[w].prepared.datums[d] for w, d in batch_rows]

    def pad(key: str) -> Tensor:  # [b,T], 0 after each row's end
        return pad_sequence([getattr(datum, key) for datum in datums], batch_first=True).to(device)

    input_ids, targets = pad("input_ids"), pad("targets")
    row_values = {key: pad(key) for key in _ROW_KEYS}
    plan = LoraPlan(slots, [work[w].slot for w, _ in batch_rows])
    train = any(work[w].prepared.job.backward for w, _ in batch_rows)

    with torch.set_grad_enabled(train), router.use(plan):
        # Right padding and no attention mask: causality alone keeps the pad tokens (all after the real
        # ones) out of every real position, and the plain causal mask takes the fastest attention path.
        logits = model(input_ids=input_ids).logits
        lp = token_logprobs(logits, targets)  # [b,T] float32; position i scores targets[i], no shift
        per_token, total = _losses(work, batch_rows, lp, row_values)
        # Inside the plan: with gradient checkpointing the backward pass re-runs layers, which must route
        # each row to the same adapter as the forward did.
        if total is not None and total.requires_grad:
            total.backward()
    return lp.detach().cpu(), per_token.cpu()


def _losses(
    work: Sequence[FbWork], batch_rows: Sequence[tuple[int, int]], lp: Tensor, row_values: dict[str, Tensor]
) -> tuple[Tensor, Tensor | None]:
    """Detached per-token losses [b,T] of the rows, and the sum of the training jobs' losses (or None).

    The losses are per token, so jobs with the same loss and parameters share one call over all their
    rows: a micro-batch of cross_entropy jobs costs one loss call, however many jobs it holds.
    """
    groups: dict[tuple[str, LossParams], list[int]] = defaultdict(list)
    for i, (w, _) in enumerate(batch_rows):
        groups[work[w].prepared.job.loss_fn, work[w].prepared.params].append(i)
    per_token = torch.zeros_like(lp, requires_grad=False)
    total: Tensor | None = None
    for rows in groups.values():
        index = None if len(rows) == len(batch_rows) else torch.tensor(rows, device=lp.device)
        group_lp = lp if index is None else lp[index]
        group_values = row_values if index is None else {k: v[index] for k, v in row_values.items()}
        prepared = work[batch_rows[rows[0]][0]].prepared  # any job of the group: same loss and params
        loss = loss_outputs(prepared, group_lp, group_values).per_token
        if index is None:
            per_token = loss.detach()
        else:
            per_token.index_copy_(0, index, loss.detach())
        trains = [work[batch_rows[i][0]].prepared.job.backward for i in rows]
        if any(trains):
            kept = loss if all(trains) else loss[torch.tensor(trains, device=lp.device)]
            total = kept.sum() if total is None else total + kept.sum()
    return per_token, total
