"""Turn environment episodes into Rollouts: many episodes advance together, one engine batch per turn.

Each episode is one token stream; policy tokens carry their behaviour logprobs and policy versions
and are trained on, environment tokens are masked out. Scripted episodes (a Python policy) produce
the same Rollouts for supervised warm-ups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
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


def _start(env: Environment, seed: int, group_id: str, chat: ChatFormat) -> Episode:
    ep = Episode(env=env, group_id=group_id, seed=seed)
    obs = env.reset(seed=seed)
    ep.last_obs = obs
    ep.add_context(chat.first_turn(obs.prompt))
    if obs.done:  # e.g. a natural in BlackJack: the hand is over before any decision
        ep.done, ep.reward = True, float(obs.reward or 0.0)
    return ep


def _advance(ep: Episode, reply_text: str, chat: ChatFormat, max_turns: int) -> None:
    """Apply the policy's reply to the environment and append the environment's answer."""
    obs = ep.env.step(TextAction(text=reply_text))
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
    seed = (sampling_seed * 1_000_003 + ep.seed * 101 + ep.turns) % (1 << 63)
    return dataclasses.replace(params, seed=seed)


def run_episodes(
    engine: Engine,
    envs: Sequence[Environment],
    seeds: Sequence[int],
    group_ids: Sequence[str],
    chat: ChatFormat,
    params: SamplingParams,
    max_turns: int,
    sampling_seed: int | None = None,
) -> list[Rollout]:
    """Play one episode per env (reset with its seed) to the end; returns rollouts in input order.

    With `sampling_seed`, every turn is sampled with its own seed derived from (sampling_seed, env
    seed, turn), so an evaluation is reproducible whatever else the engine has generated before.
    """
    if not len(envs) == len(seeds) == len(group_ids):
        raise ValueError("run_episodes needs one seed and one group id per env")
    if chat.end_of_turn_id not in params.stop_token_ids:
        params = dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, chat.end_of_turn_id))
    episodes = [_start(env, s, g, chat) for env, s, g in zip(envs, seeds, group_ids, strict=True)]
    while active := [ep for ep in episodes if not ep.done]:
        completions: list[Completion] = engine.generate(
            [SampleRequest(ep.token_ids.copy(), _turn_params(params, sampling_seed, ep)) for ep in active]
        )
        for ep, c in zip(active, completions, strict=True):
            ep.add_policy(c.token_ids, c.logprobs, c.versions)
            if c.finish_reason == "length" and c.token_ids[-1:] != [chat.end_of_turn_id]:
                # The reply never ended its turn: the env judges the text as is (usually a format error).
                ep.finish_reason = "length"
            _advance(ep, chat.reply_text(c.token_ids), chat, max_turns)
    return [ep.to_rollout() for ep in episodes]


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
