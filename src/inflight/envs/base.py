"""The Env protocol in OpenEnv's shape (openenv-core 0.3): Action, Observation, State and Environment.

Owns the in-process contract, the name registry and lockstep batches of text episodes; knows nothing of
HTTP (an adapter serves these models over OpenEnv's wire format) nor of tokens or models.
"""

from __future__ import annotations

import functools
import inspect
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from typing import Annotated, Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from inflight.errors import UserError


class Action(BaseModel):
    """Base of every action; mirrors `openenv.core.env_server.types.Action`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    metadata: dict[str, Any] = Field(default_factory=dict)


def _not_text(value: Any) -> Any:
    """A reward given as text is refused: pydantic's lax mode would read "1" as 1.0 (OpenEnv's own
    `bool | int | float` reward reads it as True), and a reward the task never meant would train."""
    if isinstance(value, str | bytes | bytearray):
        raise PydanticCustomError("float_type", "a reward is a number (bool, int or float) or None, not text")
    return value


# OpenEnv's wire format sends the reward as a JSON number (or null); a bool or an int becomes a float here.
Reward = Annotated[float | None, BeforeValidator(_not_text)]


class Observation(BaseModel):
    """Base of every observation; mirrors `openenv.core.env_server.types.Observation`.

    OpenEnv's server sends `done` and `reward` beside the observation and drops `metadata` on the
    wire, so anything a policy or a metric needs must live in a subclass's own fields.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    done: bool = False
    reward: Reward = None  # reward of the action that led here; None at reset unless already done
    metadata: dict[str, Any] = Field(default_factory=dict)


class State(BaseModel):
    """Internal episode state (may hold hidden information); mirrors OpenEnv's `State`."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    episode_id: str | None = None
    step_count: int = Field(default=0, ge=0)


class TextAction(Action):
    """What an LLM policy sends: the text it generated for this turn."""

    text: str


class TextObservation(Observation):
    """What an LLM policy reads: `prompt` is the text of the next user turn (or the outcome once done)."""

    prompt: str


ActT = TypeVar("ActT", bound=Action)
ObsT = TypeVar("ObsT", bound=Observation)
TextObsT = TypeVar("TextObsT", bound=TextObservation)
StateT = TypeVar("StateT", bound=State)


class Environment(ABC, Generic[ActT, ObsT, StateT]):
    """One episode at a time, OpenEnv's `Environment` signatures. Not thread-safe: one per session.

    An episode may already be done at reset (e.g. a dealt blackjack); callers check `obs.done` first.
    """

    # Whether reset() and step() may block (wait on I/O, a subprocess or a lock, or compute for long). The
    # pipeline then calls them in a worker thread, one call at a time: the event loop keeps serving the other
    # episodes meanwhile, and rollout.timeout_s can end an episode whose step never returns. An environment
    # whose methods are quick pure Python may set it False: they then run on the event loop, without the
    # thread hop. `step_async`, where defined, is awaited on the loop either way.
    blocking: ClassVar[bool] = True

    @abstractmethod
    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> ObsT:
        """Start a new episode; the same seed (and kwargs) gives the same episode."""

    @abstractmethod
    def step(self, action: ActT, timeout_s: float | None = None, **kwargs: Any) -> ObsT:
        """Apply one action to the current episode; raises RuntimeError if it is done or never reset."""

    @property
    @abstractmethod
    def state(self) -> StateT: ...

    def close(self) -> None:
        """Release resources (sandboxes, connections); nothing by default."""


def step_timeout(
    env: Environment[Any, Any, Any], timeout_s: float | None, method: str = "step"
) -> dict[str, float]:
    """The keyword arguments that pass `timeout_s` to `env.<method>` (`step` or `step_async`): none without a
    bound, or for an environment written against the older documented `step(self, action)`, which keeps
    working (unbounded) rather than failing every step with a TypeError."""
    function = getattr(type(env), method, None)
    if timeout_s is None or function is None or not _takes_timeout(function):
        return {}
    return {"timeout_s": timeout_s}


@functools.lru_cache(maxsize=256)
def _takes_timeout(function: Callable[..., object]) -> bool:
    """Whether `function` accepts `timeout_s` (by name or through **kwargs). Read once per environment class:
    an episode steps many times, and a run builds an environment per episode."""
    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): call it the older way
        return False
    return any(
        p.kind is p.VAR_KEYWORD or (p.name == "timeout_s" and p.kind is not p.POSITIONAL_ONLY) for p in params
    )


EnvFactory = Callable[..., Environment[Any, Any, Any]]

# name -> factory; `inflight.envs` registers the built-in environments on import.
ENVS: dict[str, EnvFactory] = {}


def register_env(name: str, factory: EnvFactory) -> None:
    if name in ENVS and ENVS[name] is not factory:
        raise ValueError(f"environment name {name!r} is already registered to {ENVS[name]!r}")
    ENVS[name] = factory


def make_env(name: str, **kwargs: Any) -> Environment[Any, Any, Any]:
    """Build a registered environment by name; kwargs go to its constructor.

    `openenv:URL` (e.g. `openenv:http://127.0.0.1:8200`) plays a remote OpenEnv-protocol server instead;
    kwargs go to `OpenEnvClientEnv`.
    """
    if name.startswith("openenv:"):
        from inflight.envs.openenv_client import OpenEnvClientEnv  # imported here: it imports this module

        return OpenEnvClientEnv(name.removeprefix("openenv:"), **kwargs)
    if name not in ENVS:
        known = ", ".join(sorted(ENVS)) or "(none registered)"
        raise UserError(f"unknown environment {name!r}; known environments: {known}")
    return ENVS[name](**kwargs)


class TextEnvBatch(Generic[TextObsT]):
    """Episodes of one text environment in lockstep, for a batched policy: each round the caller answers
    every active episode at once (one engine call for thousands of hands).

        batch = TextEnvBatch(BlackJackEnv, episode_seeds(4096, seed=0))
        while active := batch.active:
            batch.step(generate([batch.observations[i].prompt for i in active]))
        batch.returns  # [N] summed rewards, in the order of the seeds
    """

    def __init__(
        self, make: Callable[[], Environment[TextAction, TextObsT, Any]], seeds: Iterable[int]
    ) -> None:
        seeds = list(seeds)
        self.envs = [make() for _ in seeds]
        self.observations = [env.reset(seed=seed) for env, seed in zip(self.envs, seeds, strict=True)]
        self.returns = [obs.reward or 0.0 for obs in self.observations]  # [N]

    @property
    def active(self) -> list[int]:
        """Indices of the episodes waiting for an action, in the order `step` expects the texts."""
        return [i for i, obs in enumerate(self.observations) if not obs.done]

    def step(self, texts: Sequence[str]) -> list[TextObsT]:
        """Apply one action text per active episode; returns their new observations (same order)."""
        active = self.active
        if len(texts) != len(active):
            raise ValueError(f"TextEnvBatch.step got {len(texts)} texts for {len(active)} active episodes")
        for i, text in zip(active, texts, strict=True):
            self.observations[i] = obs = self.envs[i].step(TextAction(text=text))
            self.returns[i] += obs.reward or 0.0
        return [self.observations[i] for i in active]


def episode_seeds(num_episodes: int, seed: int = 0) -> list[int]:
    """Seeds of a fixed evaluation set; the list for n episodes is a prefix of the list for more."""
    rng = random.Random(seed)
    return [rng.getrandbits(63) for _ in range(num_episodes)]


def play_episodes(
    make: Callable[[], Environment[TextAction, TextObsT, Any]],
    policy: Callable[[list[TextObsT]], list[str]],
    seeds: Iterable[int],
    batch_size: int = 4096,
) -> list[float]:
    """Return of each episode dealt from `seeds`; `policy` answers a list of observations per call."""
    returns: list[float] = []
    seed_iter = iter(seeds)
    while chunk := list(islice(seed_iter, batch_size)):
        batch = TextEnvBatch(make, chunk)
        while active := batch.active:
            batch.step(policy([batch.observations[i] for i in active]))
        returns += batch.returns
    return returns
