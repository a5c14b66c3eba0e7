"""One GRPO group: a problem played `grpo.group_size` times, wherever it is played.

`play_group` is the unit of work of both loops, and of a rollout worker in a process of its own
(`launch/ray/rollout_workers.py`'s `RolloutWorker`, `ray.num_rollout_workers`): it takes everything it needs
as arguments.
A pipeline whose groups are played elsewhere reaches the players through the `GroupPlayer` protocol, which
hands back a `PlayedGroup`. The result stream's record (a group and the problem it answers) is here too,
so that a worker can append it to a stream the pipeline reads. Knows nothing of engines, buffers or steps.
"""

from __future__ import annotations

import asyncio
import copy
import json
from dataclasses import dataclass
from typing import Protocol

from inflight.buffer.codec import decode_group, encode_group
from inflight.config import RunConfig
from inflight.orchestrator.guard import GuardCounts, RolloutGuard
from inflight.orchestrator.task import Problem, Task
from inflight.rollouts.api import GenerateFn, RolloutContext
from inflight.rollouts.chat import ChatFormat
from inflight.types import Rollout, RolloutGroup, SamplingParams


def sampling_params(cfg: RunConfig) -> SamplingParams:
    """One policy turn during training."""
    return SamplingParams(
        max_tokens=cfg.sampling.max_tokens_per_turn,
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        top_k=cfg.sampling.top_k,
    )


async def play_group(
    task: Task,
    problem: Problem,
    problem_index: int,
    cfg: RunConfig,
    chat: ChatFormat,
    generate: GenerateFn,
    guard: RolloutGuard,
) -> RolloutGroup:
    """Problem `problem_index` played group_size times; the rollouts that failed are left out (the guard
    counts them). Seeded per (run seed, problem, sample, turn): the tokens do not depend on the engine's
    batch or on where the group is played, so the pipeline at max_staleness_steps=0 draws the sync loop's
    samples, and a group played again (its worker died) draws the same ones at the same weights.
    A cancellation (the run shutting down) propagates."""
    group_id = str(problem_index)
    params = sampling_params(cfg)
    contexts = [
        RolloutContext(generate, chat, params, group_id, problem_index, j, cfg.seed, cfg)
        for j in range(cfg.grpo.group_size)
    ]
    # Each rollout its own deep copy: one that changes its problem (pops its answer, counts in a nested
    # dict) changes no other sample's, nor a later step's.
    results = await asyncio.gather(
        *(guard.run(task.generate_rollout, ctx, copy.deepcopy(problem)) for ctx in contexts)
    )
    rollouts = [r for r in results if r is not None]
    for r in rollouts:
        r.group_id = group_id
    return RolloutGroup(group_id, rollouts)


def group_record(problem_index: int, group: RolloutGroup) -> bytes:
    """The result stream's record of a played group."""
    return json.dumps({"problem": problem_index, "group": encode_group(group).decode()}).encode()


def parse_group_record(record: bytes) -> tuple[int, RolloutGroup]:
    obj = json.loads(record)
    return int(obj["problem"]), decode_group(obj["group"].encode())


@dataclass
class PlayedGroup:
    """What a player hands back for one group: its rollouts, unless the player appended the group to the
    result stream itself (`appended`: a worker writing to a shared stream, Redis), and the failed-rollout
    counts its guard gathered since its last report (the pipeline's guard adds them to its own)."""

    problem_index: int
    rollouts: list[Rollout]  # [] when appended
    appended: bool
    failures: GuardCounts


class GroupPlayer(Protocol):
    """Plays a pipeline's groups somewhere other than its own event loop (`launch/ray/rollout_workers.py`'s
    actors). A group lost with its player is played again (the call returns once one play succeeded, or
    raises when none can)."""

    async def play(self, problem_index: int, problem: Problem) -> PlayedGroup: ...

    def metrics(self) -> dict[str, float]:
        """Counters of the players (played, lost and played again, restarts), logged with every step."""
        ...


def is_playable(group: RolloutGroup) -> bool:
    """A group with fewer than 2 rollouts left has no baseline to compare with: dropped, counted."""
    return len(group.rollouts) >= 2
