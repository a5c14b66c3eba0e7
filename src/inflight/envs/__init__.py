"""Environments in OpenEnv's shape and the registry `make_env` builds them from."""

from inflight.envs.base import (
    ENVS,
    Action,
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
from inflight.envs.blackjack import BlackJackEnv, BlackJackObservation

register_env("blackjack", BlackJackEnv)

__all__ = [
    "ENVS",
    "Action",
    "BlackJackEnv",
    "BlackJackObservation",
    "Environment",
    "Observation",
    "State",
    "TextAction",
    "TextEnvBatch",
    "TextObservation",
    "episode_seeds",
    "make_env",
    "play_episodes",
    "register_env",
]
