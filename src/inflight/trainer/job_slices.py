"""A Tinker forward_backward job run in slices of whole datums, and the slices' outputs merged back into the
job's own, exactly as one pass over the whole job would have given them.

The service's worker runs a large job a slice per round, so that other tenants' requests of the next round
run beside its next slice instead of waiting for all of it. Exact because Tinker's losses are sums over
tokens (each slice's gradients accumulate into the adapter as another micro-batch's would), the per-datum
outputs belong to their datum, and the job's metrics are recomputed over all of its tokens at the end
(`job_metrics`, the same call a whole pass makes), not combined from the slices' own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inflight.trainer.tinker_losses import PreparedJob, job_metrics
from inflight.trainer.types import ForwardBackwardJob, ForwardBackwardOutput


def job_tokens(job: ForwardBackwardJob) -> int:
    return sum(len(datum.input_tokens) for datum in job.data)


def split_job(job: ForwardBackwardJob, max_tokens: int) -> list[ForwardBackwardJob]:
    """Consecutive slices of the job's datums, each of at most `max_tokens` tokens, or of one datum where a
    datum alone is longer; in order, so the merged outputs list the datums as the job did. A job within
    the bound is its own only slice."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    slices: list[ForwardBackwardJob] = []
    start, tokens = 0, 0
    for i, datum in enumerate(job.data):
        n = len(datum.input_tokens)
        if i > start and tokens + n > max_tokens:
            slices.append(_slice(job, start, i))
            start, tokens = i, 0
        tokens += n
    slices.append(_slice(job, start, len(job.data)))
    return slices


def merge_outputs(job: PreparedJob, parts: Sequence[ForwardBackwardOutput]) -> ForwardBackwardOutput:
    """The whole job's output from its slices' outputs (in `split_job`'s order): the datums' outputs one
    after another, and the job's metrics over all of its tokens."""
    outputs = [output for part in parts for output in part.loss_fn_outputs]
    if len(outputs) != len(job.datums):
        raise ValueError(f"the slices' outputs list {len(outputs)} datums, the job {len(job.datums)}")
    logprobs = [torch.tensor(output["logprobs"], dtype=torch.float32) for output in outputs]
    losses = [torch.tensor(output["elementwise_loss"], dtype=torch.float32) for output in outputs]
    return ForwardBackwardOutput(loss_fn_outputs=outputs, metrics=job_metrics(job, logprobs, losses))


def _slice(job: ForwardBackwardJob, start: int, end: int) -> ForwardBackwardJob:
    return ForwardBackwardJob(
        model_id=job.model_id,
        data=job.data[start:end],
        loss_fn=job.loss_fn,
        loss_fn_config=job.loss_fn_config,
        backward=job.backward,
    )
