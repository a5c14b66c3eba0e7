"""One batched forward(/backward) over the jobs of one base model, whatever adapter each job uses.

Datums of all jobs are sorted by length and cut into micro-batches of at most `max_batch_tokens` padded
tokens; every micro-batch runs the model once with a per-row adapter plan, computes each job's Tinker loss
on its rows and back-propagates the sum of the training jobs' losses. Losses are sums, so micro-batching
is exact gradient accumulation. Knows nothing of adapters' optimizers, requests or files.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from inflight.api.engine_losses import PreparedJob, job_metrics, loss_outputs
from inflight.api.engine_types import ForwardBackwardOutput
from inflight.losses import token_logprobs
from inflight.models.lora import LoraPlan, LoraRouter
from inflight.models.lora_adapter import LoraAdapter

_ROW_KEYS = ("weights", "behaviour_logprobs", "advantages")


@dataclass
class FbWork:
    """A validated job and the slot of its adapter in the group's plan."""

    prepared: PreparedJob
    slot: int


def micro_batches(lengths: Sequence[int], max_batch_tokens: int) -> list[list[int]]:
    """Row indices grouped so that rows x longest length <= max_batch_tokens (a longer row goes alone).

    Longest first, so similar lengths share a micro-batch and little compute goes to padding.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


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
    for batch in micro_batches(lengths, max_batch_tokens):
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
    width = max(d.length for d in datums)

    def pad(key: str, dtype: torch.dtype) -> Tensor:
        out = torch.zeros(len(datums), width, dtype=dtype)
        for i, datum in enumerate(datums):
            out[i, : datum.length] = getattr(datum, key)
        return out.to(device)

    input_ids, targets = pad("input_ids", torch.long), pad("targets", torch.long)
    row_values = {key: pad(key, torch.float32) for key in _ROW_KEYS}
    plan = LoraPlan(slots, [work[w].slot for w, _ in batch_rows])
    rows_of_job: dict[int, list[int]] = defaultdict(list)
    for i, (w, _) in enumerate(batch_rows):
        rows_of_job[w].append(i)
    train = any(work[w].prepared.job.backward for w in rows_of_job)

    with torch.set_grad_enabled(train), router.use(plan):
        # Right padding and no attention mask: causality alone keeps the pad tokens (all after the real
        # ones) out of every real position, and the plain causal mask takes the fastest attention path.
        logits = model(input_ids=input_ids).logits
        lp = token_logprobs(logits, targets)  # [b,T] float32; position i scores targets[i], no shift
        per_token = torch.zeros_like(lp, requires_grad=False)
        total: Tensor | None = None
        for w, job_rows in rows_of_job.items():
            index = torch.tensor(job_rows, device=device)
            job_loss = loss_outputs(
                work[w].prepared, lp[index], {key: value[index] for key, value in row_values.items()}
            ).per_token
            per_token.index_copy_(0, index, job_loss.detach())
            if work[w].prepared.job.backward:
                total = job_loss.sum() if total is None else total + job_loss.sum()
    if total is not None and total.requires_grad:
        total.backward()
    return lp.detach().cpu(), per_token.detach().cpu()
