"""The Env protocol, registry and lockstep batches, checked with a hand-written countdown env.

Reference: openenv-core 0.3 `env_server/types.py` (field names, defaults, extra="forbid") and
`interfaces.py` (reset/step/state signatures).
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from inflight.envs import (
    ENVS,
    Action,
    BlackJackEnv,
    Environment,
    Observation,
    State,
    TextAction,
    TextEnvBatch,
    TextObservation,
    episode_seeds,
    make_env,
    play_episodes,
    register_env,
)
from inflight.errors import UserError


class Countdown(Environment[TextAction, TextObservation, State]):
    """Episode of `seed % 3 + 1` steps; each "ok" earns +1, anything else ends it with -1."""

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> TextObservation:
        self._left, self._state = (seed or 0) % 3 + 1, State(episode_id=episode_id)
        return TextObservation(prompt=f"{self._left} left")

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs: Any) -> TextObservation:
        self._state.step_count += 1
        if action.text != "ok":
            return TextObservation(prompt="bad", done=True, reward=-1.0)
        self._left -= 1
        return TextObservation(prompt=f"{self._left} left", done=self._left == 0, reward=1.0)

    @property
    def state(self) -> State:
        return self._state


def test_models_mirror_openenv_defaults() -> None:
    obs = Observation()
    assert (obs.done, obs.reward, obs.metadata) == (False, None, {})
    assert Action().metadata == {}
    assert (State().episode_id, State().step_count) == (None, 0)
    assert State(episode_id="e", extra_field=1).model_dump()["extra_field"] == 1  # State allows extras
    with pytest.raises(ValidationError):
        TextAction(text="hit", unknown=1)  # actions forbid unknown fields, as in OpenEnv
    with pytest.raises(ValidationError):
        State(step_count=-1)


def test_registry_builds_by_name_and_rejects_unknown_names() -> None:
    env = make_env("blackjack", format_penalty=-2.0)
    assert isinstance(env, BlackJackEnv) and env.format_penalty == -2.0
    with pytest.raises(UserError, match=r"unknown environment 'chess'.*blackjack"):
        make_env("chess")
    with pytest.raises(ValueError, match="already registered"):
        register_env("blackjack", Countdown)
    register_env("blackjack", BlackJackEnv)  # re-registering the same factory is harmless
    assert ENVS["blackjack"] is BlackJackEnv


def test_batch_steps_only_active_episodes_and_sums_rewards() -> None:
    batch = TextEnvBatch(Countdown, [0, 1, 2])  # lengths 1, 2, 3
    assert batch.active == [0, 1, 2]
    batch.step(["ok", "ok", "ok"])
    assert batch.active == [1, 2]
    with pytest.raises(ValueError, match="got 3 texts for 2 active"):
        batch.step(["ok", "ok", "ok"])
    new = batch.step(["ok", "oops"])
    assert [o.prompt for o in new] == ["0 left", "bad"]
    assert batch.active == []
    assert batch.returns == [1.0, 2.0, 0.0]  # the third episode: +1, then -1 for "oops"


def test_play_episodes_matches_across_batch_sizes() -> None:
    seeds = episode_seeds(50, seed=7)
    policy = lambda obs: ["ok" if o.prompt != "2 left" else "no" for o in obs]  # noqa: E731
    assert play_episodes(Countdown, policy, seeds, batch_size=7) == play_episodes(Countdown, policy, seeds)


def test_episode_seeds_are_fixed_and_prefix_stable() -> None:
    assert episode_seeds(10, seed=3) == episode_seeds(20, seed=3)[:10]
    assert episode_seeds(10, seed=3) != episode_seeds(10, seed=4)
    assert len(set(episode_seeds(1000))) == 1000
