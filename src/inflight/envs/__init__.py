"""Environments in OpenEnv's shape and the registry `make_env` builds them from."""

from inflight.envs.arithmetic import ArithmeticEnv
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
from inflight.envs.code import CodeEnv
from inflight.envs.math import MathEnv
from inflight.envs.tools import ToolsEnv

register_env("blackjack", BlackJackEnv)
register_env("arithmetic", ArithmeticEnv)
register_env("code", CodeEnv)
register_env("math", MathEnv)
register_env("tools", ToolsEnv)

__all__ = [
    "ENVS",
    "Action",
    "ArithmeticEnv",
    "BlackJackEnv",
    "BlackJackObservation",
    "CodeEnv",
    "Environment",
    "MathEnv",
    "Observation",
    "State",
    "TextAction",
    "TextEnvBatch",
    "TextObservation",
    "ToolsEnv",
    "episode_seeds",
    "make_env",
    "play_episodes",
    "register_env",
]
