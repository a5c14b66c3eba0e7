"""Turn environment episodes into Rollouts: many episodes advance together, one engine batch per turn.

Each episode is one token stream; policy tokens carry their behaviour logprobs and policy versions
and are trained on, environment tokens are masked out. Scripted episodes (a Python policy) produce
the same Rollouts for supervised warm-ups.

`play_episode` (the pipeline's, one episode per asyncio task) runs an environment's synchronous `reset` and
`step` in a worker thread (`EnvCalls`), unless the environment declares them cheap (`blocking = False`): a
step that blocks then stalls only its own episode, and `rollout.timeout_s` can end it. Each step is told the
seconds of `rollout.timeout_s` left (OpenEnv's `timeout_s`), when its signature takes them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from inflight.envs.base import Environment, TextAction, step_timeout
from inflight.inference.engine import Engine
from inflight.rollouts.chat import ChatFormat
from inflight.types import Completion, FinishReason, Rollout, SampleRequest, SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")
WORKER_IDLE_S = 60.0  # an idle worker thread exits after this long (a burst of episodes leaves none behind)


class _EnvWorkers:
    """Daemon threads for environments' synchronous methods, started whenever none is idle.

    Not a ThreadPoolExecutor: its threads are joined at interpreter exit, so one stuck for good in a step
    that never returns (the very case a thread is for) would keep the process from exiting; and a fixed
    number of them could all be stuck, starving every other episode. Stuck threads here just stay stuck.
    """

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]]] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a call that no submitted call has claimed yet

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1  # claimed: that thread takes this call (or another just as new)
        self._calls.put((future, fn))
        if start:
            threading.Thread(target=self._work, name="inflight-env", daemon=True).start()
        return future

    def _work(self) -> None:
        while True:
            try:
                future, fn = self._calls.get(timeout=WORKER_IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._idle:  # unclaimed: nobody counts on this thread; else a call is on its way
                        self._idle -= 1
                        return
                continue
            if future.set_running_or_notify_cancel():  # False: cancelled while queued, never run
                try:
                    result = fn()
                except BaseException as e:  # the env's own error, raised again in the episode's task
                    future.set_exception(e)
                else:
                    future.set_result(result)
            del future, fn  # an idle thread keeps no environment alive
            with self._lock:
                self._idle += 1


_WORKERS = _EnvWorkers()


class EnvCalls:
    """One environment's synchronous methods as awaitables, one call at a time, in order.

    In a worker thread when the environment may block (`Environment.blocking`, True unless it says
    otherwise): the event loop keeps serving every other episode meanwhile, and a timeout or a cancellation
    of the awaiting task takes effect at once (the thread finishes the call on its own, and `close` follows
    it). Inline on the loop otherwise, as the lockstep loops call them.
    """

    def __init__(self, env: Any) -> None:
        self.env = env
        self.threaded = bool(getattr(env, "blocking", True))
        self._last: concurrent.futures.Future[Any] | None = None  # the latest call sent to a thread

    async def __call__(self, fn: Callable[[], T]) -> T:
        if not self.threaded:
            return fn()
        self._last = _WORKERS.submit(fn)
        return await asyncio.wrap_future(self._last)

    def close(self) -> None:
        """`env.close()`: inline for an env that does not block (its error raised here); else in a worker
        thread once no call of it runs, never waited for (after a timed-out step, when that step returns)
        and its error only logged: the episode is over either way."""
        if not self.threaded:
            self.env.close()
            return

        def close() -> None:
            try:
                self.env.close()
            except Exception as e:
                log.warning("closing %s after its episode failed: %s", type(self.env).__name__, e)

        last = self._last
        if last is None or last.done():
            _WORKERS.submit(close)
        else:
            last.add_done_callback(lambda _: close())  # runs in the thread that finishes `last`


@dataclass
class Episode:
    """The growing token stream of one episode."""

    env: Environment
    group_id: str
    seed: int = 0
    sample_index: int = 0  # which of the group's samples: keys its sampling seeds apart from the others'
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    done: bool = False
    reward: float = 0.0
    finish_reason: FinishReason = "stop"
    last_obs: Any = None

    def add_context(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.loss_mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_policy(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        self.token_ids += ids
        self.loss_mask += [True] * len(ids)
        self.logprobs += logprobs
        self.versions += versions

    def to_rollout(self) -> Rollout:
        metrics = {
            k: float(v) for k, v in (self.last_obs.metadata or {}).items() if isinstance(v, int | float)
        }
        metrics["turns"] = float(self.turns)
        return Rollout(
            token_ids=self.token_ids,
            loss_mask=self.loss_mask,
            logprobs=self.logprobs,
            versions=self.versions,
            reward=self.reward,
            group_id=self.group_id,
            finish_reason=self.finish_reason,
            metrics=metrics,
        )


def _start(env: Environment, seed: int, group_id: str, chat: ChatFormat, sample_index: int = 0) -> Episode:
    ep = Episode(env=env, group_id=group_id, seed=seed, sample_index=sample_index)
    return _opened(ep, env.reset(seed=seed), chat)


def _opened(ep: Episode, obs: Any, chat: ChatFormat) -> Episode:
    """`ep` after its reset observation `obs`."""
    _check_observation(obs, type(ep.env).__name__, "reset")
    ep.last_obs = obs
    ep.add_context(chat.first_turn(obs.prompt))
    if obs.done:  # e.g. a natural in BlackJack: the hand is over before any decision
        ep.done, ep.reward = True, float(obs.reward or 0.0)
    return ep


def _check_observation(obs: Any, env_name: str, method: str) -> None:
    """An observation the episode can read; else a TypeError naming the method (not an AttributeError)."""
    if not (hasattr(obs, "done") and hasattr(obs, "prompt")):
        raise TypeError(
            f"{env_name}.{method}() returned a {type(obs).__name__}, not an observation with `prompt` and "
            "`done` (e.g. a TextObservation)"
        )


def _advance(ep: Episode, reply_text: str, chat: ChatFormat, max_turns: int) -> None:
    """Apply the policy's reply to the environment and append the environment's answer."""
    _observe(ep, ep.env.step(TextAction(text=reply_text)), chat, max_turns)


def _observe(ep: Episode, obs: Any, chat: ChatFormat, max_turns: int) -> None:
    _check_observation(obs, type(ep.env).__name__, "step")
    ep.turns += 1
    ep.last_obs = obs
    if obs.done:
        ep.done, ep.reward = True, float(obs.reward or 0.0)
    elif ep.turns >= max_turns:
        ep.done, ep.reward, ep.finish_reason = True, float(obs.reward or 0.0), "length"
    else:
        ep.add_context(chat.next_turn(obs.prompt))


def _turn_params(params: SamplingParams, sampling_seed: int | None, ep: Episode) -> SamplingParams:
    if sampling_seed is None:
        return params
    seed = (sampling_seed * 1_000_003 + ep.seed * 101 + ep.turns + ep.sample_index * 1_000_000_007) % (
        1 << 63
    )
    return dataclasses.replace(params, seed=seed)


def _with_end_of_turn(params: SamplingParams, chat: ChatFormat) -> SamplingParams:
    """`params` that also stop at the end-of-turn token and the model's EOS ids."""
    stops = tuple(dict.fromkeys((*params.stop_token_ids, *chat.stop_token_ids)))
    return params if stops == params.stop_token_ids else dataclasses.replace(params, stop_token_ids=stops)


def _add_reply(ep: Episode, c: Completion, chat: ChatFormat) -> str:
    ep.add_policy(c.token_ids, c.logprobs, c.versions)
    if c.finish_reason == "length" and c.token_ids[-1:] != [chat.end_of_turn_id]:
        # The reply never ended its turn: the env judges the text as is (usually a format error).
        ep.finish_reason = "length"
    return chat.reply_text(c.token_ids)


def _take_reply(ep: Episode, c: Completion, chat: ChatFormat, max_turns: int) -> None:
    _advance(ep, _add_reply(ep, c, chat), chat, max_turns)


def run_episodes(
    engine: Engine,
    envs: Sequence[Environment],
    seeds: Sequence[int],
    group_ids: Sequence[str],
    chat: ChatFormat,
    params: SamplingParams,
    max_turns: int,
    sampling_seed: int | None = None,
    sample_indices: Sequence[int] | None = None,
) -> list[Rollout]:
    """Play one episode per env (reset with its seed) to the end; returns rollouts in input order.

    With `sampling_seed`, every turn is sampled with its own seed derived from (sampling_seed, env
    seed, sample index, turn), so an episode's tokens do not depend on what else the engine runs: an
    evaluation is reproducible, and the asynchronous pipeline reproduces the sync loop's samples.
    """
    indices = list(sample_indices) if sample_indices is not None else [0] * len(envs)
    if not len(envs) == len(seeds) == len(group_ids) == len(indices):
        raise ValueError("run_episodes needs one seed, one group id and one sample index per env")
    params = _with_end_of_turn(params, chat)
    episodes = [
        _start(env, s, g, chat, j) for env, s, g, j in zip(envs, seeds, group_ids, indices, strict=True)
    ]
    while active := [ep for ep in episodes if not ep.done]:
        completions: list[Completion] = engine.generate(
            [SampleRequest(ep.token_ids.copy(), _turn_params(params, sampling_seed, ep)) for ep in active]
        )
        for ep, c in zip(active, completions, strict=True):
            _take_reply(ep, c, chat, max_turns)
    return [ep.to_rollout() for ep in episodes]


async def play_episode(
    generate: Callable[[SampleRequest], Awaitable[Completion]],
    env: Environment,
    seed: int,
    group_id: str,
    chat: ChatFormat,
    params: SamplingParams,
    max_turns: int,
    sampling_seed: int | None = None,
    sample_index: int = 0,
    close: bool = False,
    deadline: float | None = None,
) -> Rollout:
    """One episode against an asynchronous policy (the pipeline's rollout workers).

    Same token layout and the same per-turn seeds as `run_episodes`: with equal weights both give
    the same tokens. `close`: close `env` when the episode ends, however it ends (after a step still
    running in its thread, when the episode was cancelled or timed out). `deadline` (time.monotonic(): the
    rollout's, `RolloutContext.deadline`): each step gets the seconds left as OpenEnv's `timeout_s`, so an
    environment that can bound its work (a sandbox, a remote call) ends it in time.
    """
    params = _with_end_of_turn(params, chat)
    calls = EnvCalls(env)
    try:
        ep = Episode(env=env, group_id=group_id, seed=seed, sample_index=sample_index)
        _opened(ep, await calls(lambda: env.reset(seed=seed)), chat)
        while not ep.done:
            c = await generate(SampleRequest(ep.token_ids.copy(), _turn_params(params, sampling_seed, ep)))
            action = TextAction(text=_add_reply(ep, c, chat))
            # Environments that wait (sandboxed code, remote servers) may offer step_async, awaited here on
            # the loop; a synchronous step runs in a worker thread unless the env says it is cheap.
            step_async = getattr(env, "step_async", None)
            if step_async is not None:
                obs = await step_async(action, **step_timeout(env, _time_left_s(deadline), "step_async"))
            else:
                step = functools.partial(env.step, action, **step_timeout(env, _time_left_s(deadline)))
                obs = await calls(step)
            _observe(ep, obs, chat, max_turns)
        return ep.to_rollout()
    finally:
        if close:
            calls.close()


def _time_left_s(deadline: float | None) -> float | None:
    """Seconds until `deadline` (time.monotonic()); None without one. At least 1 ms: once it passed, the
    guard cancels the episode at its next await, and the bounds a step passes on must be > 0 (OpenEnv's
    `timeout_s`, a sandbox's `wall_s`)."""
    return None if deadline is None else max(deadline - time.monotonic(), 1e-3)


def run_scripted_episode(
    env: Environment, seed: int, policy: Callable[[Any], str], chat: ChatFormat, max_turns: int
) -> Rollout:
    """One episode whose replies come from a Python policy (logprob 0, version -1): warm-up data."""
    ep = _start(env, seed, group_id=f"scripted-{seed}", chat=chat)
    while not ep.done:
        reply = policy(ep.last_obs)
        ids = chat.assistant_reply(reply)
        ep.add_policy(ids, [0.0] * len(ids), [-1] * len(ids))
        _advance(ep, reply, chat, max_turns)
    return ep.to_rollout()
