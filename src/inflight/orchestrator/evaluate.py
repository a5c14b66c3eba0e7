"""Evaluation on a task's "test" split, PipelineRL's way: the task's own `generate_rollout` on the first
N test problems, once greedy and once sampled at the training temperature.

The sampled evaluation seeds every turn from `eval.seed`, so each evaluation of each policy sees the same
problems and the same random numbers (a paired comparison). Greedy decoding is a function of the prompt, so
the greedy evaluation generates each distinct request once and hands the result to every rollout that asks
it again (`greedy_once`): BlackJack's 10,000 test hands start from 2,815 distinct first turns, and its
greedy evaluation sends ~45% fewer requests to the engine. Failed rollouts are counted and left out, under
the guard's rules. Each rollout gets its own deep copy of its problem. Knows nothing of training: the policy
comes through a `Driver` (`drivers.py`), and the loops log what this returns under `test/`.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import statistics
from contextlib import nullcontext

from inflight.config import RunConfig
from inflight.metrics.progress import StepProgress
from inflight.orchestrator.drivers import Driver
from inflight.orchestrator.guard import RolloutGuard
from inflight.orchestrator.task import Problems, Task
from inflight.rollouts.api import GenerateFn, RolloutContext
from inflight.rollouts.chat import ChatFormat
from inflight.types import Completion, Rollout, SampleRequest, SamplingParams


def evaluate(
    task: Task,
    problems: Problems,
    cfg: RunConfig,
    chat: ChatFormat,
    driver: Driver,
    num_problems: int,
    title: str | None = None,
) -> dict[str, float]:
    """On the first `num_problems` test problems: the mean of every rollout metric (e.g. `correct`) and
    `return` under greedy decoding (with a `_greedy` suffix) and, on the first `eval.num_episodes_sampled`
    of them, of the sampling policy; the failed rollouts of each (`rollout_errors_greedy`,
    `rollout_errors`). `title` ("initial evaluation"): shows its progress (`cfg.progress`), episodes
    finished and their mean reward; None for one beside the training's own progress."""
    batch = [problems[i] for i in range(min(num_problems, len(problems)))]
    if not batch:
        return {}
    greedy = _play(task, batch, cfg, chat, driver, greedy=True, title=title)
    sampled_cap = cfg.eval.num_episodes_sampled
    sampled_batch = batch if sampled_cap is None else batch[:sampled_cap]
    sampled = (
        _play(task, sampled_batch, cfg, chat, driver, greedy=False, title=title) if sampled_batch else {}
    )
    return greedy | sampled


def _play(
    task: Task,
    batch: list[dict],
    cfg: RunConfig,
    chat: ChatFormat,
    driver: Driver,
    greedy: bool,
    title: str | None,
) -> dict[str, float]:
    suffix, kind = ("_greedy", "greedy") if greedy else ("", "sampled")
    temperature = 0.0 if greedy else cfg.sampling.temperature
    params = SamplingParams(max_tokens=cfg.sampling.max_tokens_per_turn, temperature=temperature)
    guard = RolloutGuard(
        cfg.rollout, min_rollouts=len(batch), what=f"test rollouts ({kind})", phase=f"{kind} evaluation"
    )
    progress = _progress(cfg, f"{cfg.recipe} ({title}, {kind})", len(batch)) if title else None
    rewards: list[float] = []  # of the rollouts done so far (a failed one has none), for the progress
    done = 0

    def finished(rollout: Rollout | None) -> None:
        nonlocal done
        done += 1
        rewards.extend([rollout.reward] if rollout is not None else [])
        if progress is not None:
            progress.update(done, statistics.fmean(rewards) if rewards else None)

    async def play(generate: GenerateFn) -> list[Rollout | None]:
        if greedy:
            generate = greedy_once(generate)
        seed = None if greedy else cfg.eval.seed
        contexts = [
            RolloutContext(generate, chat, params, f"test-{i}", i, 0, seed, cfg) for i in range(len(batch))
        ]
        slots = asyncio.Semaphore(episodes_in_flight(cfg))

        async def one(ctx: RolloutContext, problem: dict) -> Rollout | None:
            async with slots:  # the rollout's timeout runs from here, not while it waits for a slot
                # Its own deep copy: a rollout that changes its problem (pops its answer, say) leaves it
                # whole for the other pass and the next evaluation.
                rollout = await guard.run(task.generate_rollout, ctx, copy.deepcopy(problem))
            finished(rollout)
            return rollout

        return await asyncio.gather(
            *(one(ctx, problem) for ctx, problem in zip(contexts, batch, strict=True))
        )

    with progress or nullcontext():
        rollouts = [r for r in driver.run(play) if r is not None]
    guard.check()
    if not rollouts:  # max_failed_frac=1 lets every one fail: nothing to average
        return {f"rollout_errors{suffix}": float(guard.failed)}
    out = {f"return{suffix}": statistics.fmean(r.reward for r in rollouts)}
    for key in sorted({k for r in rollouts for k in r.metrics}):
        out[f"{key}{suffix}"] = statistics.fmean(r.metrics.get(key, 0.0) for r in rollouts)
    out[f"rollout_errors{suffix}"] = float(guard.failed)
    return out


def _progress(cfg: RunConfig, description: str, episodes: int) -> StepProgress:
    # A line at the first episode, about every tenth of them and the last: an evaluation of 10,000 episodes
    # says it is alive without printing thousands of lines.
    every = max(cfg.metrics.print_every_steps, -(-episodes // 10))
    return StepProgress(episodes, description, enabled=cfg.progress, every_steps=every, unit="episode")


def episodes_in_flight(cfg: RunConfig) -> int:
    """`eval.max_episodes_in_flight`, or the rows the run's engines decode at once.

    Measured on BlackJack's 10,000 test hands (AMD EPYC, 2 cores): all at once 21 s, as many as the
    engine's 128 rows 17-18 s (the later turns find their K/V in the prefix cache: half the prefill
    tokens), twice that 39 s (they do not, and wait behind first turns)."""
    if cfg.eval.max_episodes_in_flight is not None:
        return cfg.eval.max_episodes_in_flight
    if cfg.pipeline.engine_urls:
        replicas = len(cfg.pipeline.engine_urls)
    elif cfg.launcher == "ray":
        replicas = cfg.ray.num_engine_replicas
    else:
        replicas = 1
    return cfg.engine.max_batch_size * replicas


def greedy_once(generate: GenerateFn) -> GenerateFn:
    """`generate` for greedy requests, each distinct one (prompt tokens, parameters, adapter) generated
    once and its completion shared by every caller, also while it is in flight. Exact for a deterministic
    policy; a batch-dependent rounding could in principle flip a near-tie between two tokens. Only for
    temperature 0: a sampled request is passed through."""
    shared: dict[tuple, asyncio.Future[Completion]] = {}

    async def generate_once(request: SampleRequest) -> Completion:
        if request.params.temperature > 0 or request.prompt_logprobs or request.topk_prompt_logprobs:
            return await generate(request)
        key = (tuple(request.prompt_token_ids), request.params, request.adapter)
        future = shared.get(key)
        if future is None:
            # Its own task: one caller's timeout or cancellation leaves the others theirs.
            future = shared[key] = asyncio.ensure_future(generate(request))
        done = await asyncio.shield(future)
        return dataclasses.replace(
            done,
            request_id=request.request_id,
            prompt_token_ids=list(done.prompt_token_ids),
            token_ids=list(done.token_ids),
            logprobs=list(done.logprobs),
            versions=list(done.versions),
        )

    return generate_once
