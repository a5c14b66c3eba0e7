"""Turn environment episodes into Rollouts: many episodes advance together, one engine batch per turn.

Each episode is one token stream; policy tokens carry their behaviour logprobs and policy versions
and are trained on, environment tokens are masked out. Scripted episodes (a Python policy) produce
the same Rollouts for supervised warm-ups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from inflight.envs.base import Environment, TextAction
from inflight.inference.engine import Engine
from inflight.rollouts.chat import ChatFormat
from inflight.types import Completion, FinishReason, Rollout, SampleRequest, SamplingParams


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
    obs = env.reset(seed=seed)
    ep.last_obs = obs
    ep.add_context(chat.first_turn(obs.prompt))
    if obs.done:  # e.g. a natural in BlackJack: the hand is over before any decision
        ep.done, ep.reward = True, float(obs.reward or 0.0)
    return ep


def _advance(ep: Episode, reply_text: str, chat: ChatFormat, max_turns: int) -> None:
    """Apply the policy's reply to the environment and append the environment's answer."""
    _observe(ep, ep.env.step(TextAction(text=reply_text)), chat, max_turns)


def _observe(ep: Episode, obs: Any, chat: ChatFormat, max_turns: int) -> None:
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
) -> Rollout:
    """One episode against an asynchronous policy (the pipeline's rollout workers).

    Same token layout and the same per-turn seeds as `run_episodes`: with equal weights both give
    the same tokens.
    """
    params = _with_end_of_turn(params, chat)
    ep = _start(env, seed, group_id, chat, sample_index)
    while not ep.done:
        c = await generate(SampleRequest(ep.token_ids.copy(), _turn_params(params, sampling_seed, ep)))
        action = TextAction(text=_add_reply(ep, c, chat))
        # Environments that wait (sandboxed code, remote servers) offer step_async: the event loop
        # keeps serving the other rollouts meanwhile.
        step_async = getattr(env, "step_async", None)
        obs = await step_async(action) if step_async is not None else env.step(action)
        _observe(ep, obs, chat, max_turns)
    return ep.to_rollout()


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
