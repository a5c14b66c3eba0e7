"""Sample tables: a few rollouts of a step as (prompt, completion, reward) rows, decoded for people."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from inflight.metrics.sink import SampleRow
from inflight.types import Rollout


def sample_rows(
    rollouts: Sequence[Rollout], decode: Callable[[list[int]], str], count: int
) -> list[SampleRow]:
    """`count` rollouts spread evenly over `rollouts` (so, usually, over different groups and prompts).

    The prompt is the token stream before the first generated token; the completion is everything after
    it, environment turns of a multi-turn episode included, as the policy saw it.
    """
    if not rollouts or count < 1:
        return []
    count = min(count, len(rollouts))
    picked = [rollouts[i * len(rollouts) // count] for i in range(count)]
    rows = []
    for rollout in picked:
        first = next((t for t, trained in enumerate(rollout.loss_mask) if trained), len(rollout.token_ids))
        rows.append(
            SampleRow(
                prompt=decode(rollout.token_ids[:first]),
                completion=decode(rollout.token_ids[first:]),
                reward=float(rollout.reward),
            )
        )
    return rows
