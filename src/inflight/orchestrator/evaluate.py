"""Evaluation on a task's "test" split, PipelineRL's way: the task's own `generate_rollout` on the first
N test problems, once greedy and once sampled at the training temperature.

The sampled evaluation seeds every turn from `eval.seed`, so each evaluation of each policy sees the same
problems and the same random numbers (a paired comparison). Failed rollouts are counted and left out,
under the guard's rules. Knows nothing of training: the policy comes through a `Driver` (`drivers.py`), and
the loops log what this returns under `test/`.
"""

from __future__ import annotations

import asyncio
import statistics

from inflight.config import RunConfig
from inflight.orchestrator.drivers import Driver
from inflight.orchestrator.guard import RolloutGuard
from inflight.orchestrator.task import Problems, Task
from inflight.rollouts.api import GenerateFn, RolloutContext
from inflight.rollouts.chat import ChatFormat
from inflight.types import Rollout, SamplingParams


def evaluate(
    task: Task, problems: Problems, cfg: RunConfig, chat: ChatFormat, driver: Driver, num_problems: int
) -> dict[str, float]:
    """On the first `num_problems` test problems: `return` and the mean of every rollout metric (e.g.
    `correct`) of the sampling policy, the same with a `_greedy` suffix for greedy decoding, and the
    failed rollouts of each (`rollout_errors`, `rollout_errors_greedy`)."""
    batch = [dict(problems[i]) for i in range(min(num_problems, len(problems)))]
    if not batch:
        return {}
    greedy = _play(task, batch, cfg, chat, driver, greedy=True)
    sampled = _play(task, batch, cfg, chat, driver, greedy=False)
    return greedy | sampled


def _play(
    task: Task, batch: list[dict], cfg: RunConfig, chat: ChatFormat, driver: Driver, greedy: bool
) -> dict[str, float]:
    suffix = "_greedy" if greedy else ""
    temperature = 0.0 if greedy else cfg.sampling.temperature
    params = SamplingParams(max_tokens=cfg.sampling.max_tokens_per_turn, temperature=temperature)
    guard = RolloutGuard(cfg.rollout, min_rollouts=len(batch), what=f"test rollouts ({suffix or 'sampled'})")

    async def play(generate: GenerateFn) -> list[Rollout | None]:
        seed = None if greedy else cfg.eval.seed
        contexts = [
            RolloutContext(generate, chat, params, f"test-{i}", i, 0, seed, cfg) for i in range(len(batch))
        ]
        return await asyncio.gather(
            *(
                guard.run(task.generate_rollout, ctx, problem)
                for ctx, problem in zip(contexts, batch, strict=True)
            )
        )

    rollouts = [r for r in driver.run(play) if r is not None]
    guard.check()
    if not rollouts:  # max_failed_frac=1 lets every one fail: nothing to average
        return {f"rollout_errors{suffix}": float(guard.failed)}
    out = {f"return{suffix}": statistics.fmean(r.reward for r in rollouts)}
    for key in sorted({k for r in rollouts for k in r.metrics}):
        out[f"{key}{suffix}"] = statistics.fmean(r.metrics.get(key, 0.0) for r in rollouts)
    out[f"rollout_errors{suffix}"] = float(guard.failed)
    return out
