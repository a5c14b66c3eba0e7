"""What `inflight run` trains on: a Task, in PipelineRL's shape whatever shape its TARGET was written in.

A Task is `load_problems(split) -> problems` and `async generate_rollout(ctx, problem) -> Rollout`, plus the
target's optional `preset()`, `warmup_reply(seen, rng)` and `summarize(cfg, initial, final)`. A target
written as an Env (a class or factory in OpenEnv's shape, or `openenv:URL`) becomes a Task here
(`env_task`): its problems are episode seeds and each rollout plays one episode. Owns the Task type, the
Env adapter and which problem a run trains on at index k; knows nothing of where a target came from
(`target.py`) nor of engines and trainers.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import random
import threading
import typing
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, overload

from pydantic import ConfigDict, TypeAdapter, ValidationError

from inflight.config import RunConfig
from inflight.envs.base import EnvFactory, Environment
from inflight.errors import UserError, describe
from inflight.rollouts.api import RolloutContext
from inflight.rollouts.episodes import play_episode
from inflight.types import Rollout

Problem = dict[str, Any]
Problems = Sequence[Problem]
GenerateRollout = Callable[[RolloutContext, Problem], Awaitable[Rollout]]
# (what the policy sees: an Env's observation, or a rollout function's transcript so far; rng) -> reply.
WarmupReply = Callable[[Any, random.Random], str]
# (cfg, initial, final) -> extra summary keys; initial/final are evaluations before and after RL.
Summarize = Callable[[RunConfig, dict[str, float], dict[str, float]], dict[str, Any]]


class HookError(UserError):
    """A task's optional function (`preset`, `warmup_reply`, `summarize`) raised or returned the wrong type:
    a bug in the task, reported in one line, never counted as a failed rollout (`guard.py` passes it on)."""


ENV_TEST_SEED = 1_000_000  # an Env task's test split: the episode seeds `episode_seeds(n, ENV_TEST_SEED)`
ENV_SPLIT_SIZE = 2**62  # an Env task's splits never run out: len() of its problem sequences


@dataclass(frozen=True)
class Task:
    """A resolved TARGET (see `target.py`). `env` is set for tasks written as an Env (`env_task`)."""

    name: str  # the run's name (`cfg.recipe`, runs/NAME-TIME): a recipe name, a file's stem, a module's
    load_problems: Callable[[str], Problems]
    generate_rollout: GenerateRollout
    preset: Callable[[], RunConfig] = RunConfig
    warmup_reply: WarmupReply | None = None
    summarize: Summarize | None = None
    env: EnvFactory | None = None

    def config(self) -> RunConfig:
        """The target's preset, named after the task."""
        try:
            cfg = self.preset()
        except UserError:
            raise
        except Exception as e:
            raise HookError(f"{self.name}: preset() raised {describe(e)}") from None
        if not isinstance(cfg, RunConfig):
            raise HookError(f"{self.name}: preset() must return a RunConfig, not {type(cfg).__name__}")
        return cfg.model_copy(update={"recipe": self.name})

    def summary_keys(
        self, cfg: RunConfig, initial: dict[str, float], final: dict[str, float]
    ) -> dict[str, Any]:
        """The task's `summarize(cfg, initial, final)` ({} without one), checked: a dict of str keys to
        values JSON can write (summary.json), else HookError."""
        if self.summarize is None:
            return {}
        try:
            keys = self.summarize(cfg, initial, final)
        except UserError:
            raise
        except Exception as e:
            raise HookError(f"{self.name}: summarize(cfg, initial, final) raised {describe(e)}") from None
        expected = (
            f"{self.name}: summarize(cfg, initial, final) must return a dict of str keys to JSON values"
        )
        if not isinstance(keys, dict):
            raise HookError(f"{expected}, not a {type(keys).__name__}: {keys!r:.60}")
        bad = next((k for k in keys if not isinstance(k, str)), None)
        if bad is not None:
            raise HookError(f"{expected}; one key is a {type(bad).__name__}: {bad!r:.40}")
        for key, value in keys.items():
            try:
                json.dumps(value, allow_nan=True)
            except (TypeError, ValueError):
                raise HookError(f"{expected}; {key!r} is a {type(value).__name__}: {value!r:.40}") from None
        return keys

    def make_env(self, cfg: RunConfig, split: str) -> Environment:
        """An Env task's environment for `split` (see `make_env`)."""
        return make_env(self.env, cfg, split)


def make_env(factory: EnvFactory | None, cfg: RunConfig, split: str) -> Environment:
    """`factory(**cfg.env.kwargs)`, or the environment `cfg.env.name` names in its place (a registered name
    or `openenv:URL`). A constructor that takes `split` gets the split ("train" or "test")."""
    from inflight.envs import ENVS
    from inflight.envs import make_env as make_named_env

    if cfg.env.name:
        named = ENVS.get(cfg.env.name)
        kwargs = checked_env_kwargs(named, cfg.env.kwargs, cfg.env.name)
        return make_named_env(cfg.env.name, **_with_split(named, kwargs, split, cfg.env.name))
    if factory is None:
        raise UserError("this task is written with generate_rollout and has no Env: unset env.name")
    name = getattr(factory, "__name__", "the environment")
    kwargs = checked_env_kwargs(factory, cfg.env.kwargs, name)
    return factory(**_with_split(factory, kwargs, split, name))


def _with_split(factory: EnvFactory | None, kwargs: dict[str, Any], split: str, name: str) -> dict[str, Any]:
    """`kwargs` with the run's `split` for a constructor that takes one. An env.kwargs.split of its own
    would be overwritten in every episode (training plays "train", evaluation "test"): refused."""
    if not _takes_split(factory):
        return kwargs
    if "split" in kwargs:
        raise UserError(
            f'env.kwargs.split={kwargs["split"]!r:.40}: {name} gets its split from the run ("train" to '
            'train on, "test" to evaluate on), which would overwrite this one: drop env.kwargs.split'
        )
    return {**kwargs, "split": split}


def checked_env_kwargs(factory: EnvFactory | None, kwargs: dict[str, Any], name: str) -> dict[str, Any]:
    """`kwargs` checked against `factory`'s annotations, converted where a value says the same thing in
    another type (`"3"` for an int, `3` for a float or a str): a wrong type is a UserError naming the kwarg,
    the type and the fix, raised where `run` builds the first environment (`check_task`, before any weights
    load) rather than a TypeError in every rollout. Arguments without an annotation it can read pass as
    given; unknown names are `preflight.check_env`'s."""
    checked = dict(kwargs)
    if not checked:  # every episode builds an environment: most tasks pass no kwargs
        return checked
    arguments = _kwarg_checks(factory)
    for key, value in kwargs.items():
        if key not in arguments:
            continue
        check = arguments[key]
        try:
            checked[key] = check.validate(value)
        except ValidationError:
            example = f", e.g. env.kwargs.{key}={check.default} (its default)" if check.default else ""
            raise UserError(
                f"env.kwargs.{key}={value!r:.40} is a {type(value).__name__}, but {name} takes `{key}: "
                f"{check.annotation}`: pass a value of that type{example}"
            ) from None
    return checked


@dataclass(frozen=True)
class _KwargCheck:
    annotation: str  # as shown in messages: `int`, `int | None`
    validate: Callable[[Any], Any]  # the value in the annotation's type; ValidationError when it is none
    default: str  # the default as typed after env.kwargs.NAME=, "" when none


def _kwarg_checks(factory: EnvFactory | None) -> dict[str, _KwargCheck]:
    """The checks of `factory`'s annotated keyword arguments, read once per factory."""
    try:
        return _kwarg_checks_cached(factory)
    except TypeError:  # an unhashable factory: read it every time
        return _read_kwarg_checks(factory)


@functools.lru_cache(maxsize=256)
def _kwarg_checks_cached(factory: EnvFactory | None) -> dict[str, _KwargCheck]:
    return _read_kwarg_checks(factory)


def _read_kwarg_checks(factory: EnvFactory | None) -> dict[str, _KwargCheck]:
    if factory is None:
        return {}
    try:
        params = inspect.signature(factory).parameters
        # String annotations (`from __future__ import annotations`) resolved in the factory's module.
        hints = typing.get_type_hints(factory.__init__ if inspect.isclass(factory) else factory)
    except Exception:  # no signature (a builtin), or an annotation that does not resolve: check nothing
        return {}
    # Lax mode converts what says the same thing ("3" -> 3, 3 -> 3.0, "true" -> True); a number is also a
    # str, since the command line parses env.kwargs.name=123 as one.
    config = ConfigDict(arbitrary_types_allowed=True, coerce_numbers_to_str=True)
    checks = {}
    for key, param in params.items():
        hint = hints.get(key)
        if hint is None or hint is Any or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        try:
            validate = TypeAdapter(hint, config=config).validate_python
        except Exception:  # a type pydantic cannot check: passed as given
            continue
        checks[key] = _KwargCheck(_shown_type(hint), validate, _shown_default(param.default))
    return checks


def _shown_default(default: Any) -> str:
    if default is inspect.Parameter.empty or default is None:
        return ""
    if isinstance(default, str):  # as typed on the command line
        return default
    try:
        return json.dumps(default)
    except (TypeError, ValueError):
        return ""


def _shown_type(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _takes_split(factory: EnvFactory | None) -> bool:
    """Read once per factory (a signature costs ~90 us, and every episode builds an environment)."""
    try:
        return _takes_split_cached(factory)
    except TypeError:  # an unhashable factory: read it every time
        return _reads_split(factory)


@functools.lru_cache(maxsize=256)
def _takes_split_cached(factory: EnvFactory | None) -> bool:
    return _reads_split(factory)


def _reads_split(factory: EnvFactory | None) -> bool:
    if factory is None:
        return False
    try:
        return "split" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): pass nothing
        return False


def env_task(
    name: str,
    factory: EnvFactory,
    preset: Callable[[], RunConfig] | None = None,
    warmup_reply: WarmupReply | None = None,
    summarize: Summarize | None = None,
) -> Task:
    """A task written as an Env: problem = {"seed", "split"}; a rollout plays one episode to its end.

    Train seeds are 0, 1, 2, ... in order; test seeds are `episode_seeds(n, ENV_TEST_SEED)` (random 63-bit
    numbers: disjoint from the train seeds, the same for every run). An environment whose constructor takes
    `split` also gets "train" or "test", so a dataset-backed one can hold problems out.
    """
    rollouts = _EnvRollouts(factory)
    return Task(
        name,
        rollouts.load_problems,
        rollouts.generate_rollout,
        preset or RunConfig,
        warmup_reply,
        summarize,
        env=factory,
    )


class _EnvRollouts:
    def __init__(self, factory: EnvFactory) -> None:
        self.factory = factory

    def load_problems(self, split: str) -> Problems:
        if split == "train":
            return EpisodeSeeds(split, lambda i: i)
        if split == "test":
            return EpisodeSeeds(split, _RandomSeeds(ENV_TEST_SEED))
        raise ValueError(f"an Env task has splits 'train' and 'test', not {split!r}")

    async def generate_rollout(self, ctx: RolloutContext, problem: Problem) -> Rollout:
        cfg = ctx.config
        env = make_env(self.factory, cfg, problem.get("split", "train"))
        # Turns are seeded by (sampling seed, episode seed, sample, turn), as in `run_episodes`. The episode
        # closes the env however it ends: after a step still running in its worker thread, if timed out.
        return await play_episode(
            ctx.generate_fn,
            env,
            int(problem["seed"]),
            ctx.group_id,
            ctx.chat_format,
            ctx.params,
            cfg.grpo.max_turns,
            sampling_seed=ctx.sampling_seed,
            sample_index=ctx.sample_index,
            close=True,
            deadline=ctx.deadline,
        )


class EpisodeSeeds(Sequence[Problem]):
    """An Env task's problems `{"seed": seed_at(i), "split": split}`, computed when read; never runs out."""

    def __init__(self, split: str, seed_at: Callable[[int], int]) -> None:
        self.split, self._seed_at = split, seed_at

    def __len__(self) -> int:
        return ENV_SPLIT_SIZE

    @overload
    def __getitem__(self, i: int) -> Problem: ...
    @overload
    def __getitem__(self, i: slice) -> list[Problem]: ...
    def __getitem__(self, i: int | slice) -> Problem | list[Problem]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not 0 <= i < ENV_SPLIT_SIZE:
            raise IndexError(i)
        return {"seed": self._seed_at(i), "split": self.split}


class _RandomSeeds:
    """Seed i of `episode_seeds(n, seed)` for any i < n, drawn as far as asked (the list is a prefix)."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._seeds: list[int] = []
        self._lock = threading.Lock()  # the pipeline evaluates in the trainer's thread

    def __call__(self, i: int) -> int:
        with self._lock:
            while len(self._seeds) <= i:
                self._seeds.append(self._rng.getrandbits(63))
            return self._seeds[i]


def load_split(task: Task, split: str) -> Problems:
    """`task.load_problems(split)`, checked: a non-empty sequence of dicts, or a UserError saying so."""
    try:
        problems = task.load_problems(split)
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"{task.name}: load_problems({split!r}) raised {describe(e)}") from None
    expected = f"{task.name}: load_problems({split!r}) must return a list of dicts"
    if isinstance(problems, str | bytes | dict) or not isinstance(problems, Sequence):
        raise UserError(f"{expected}, not a {type(problems).__name__}")
    if not len(problems):
        hint = "; set eval.num_episodes=0 to train without evaluation" if split == "test" else ""
        raise UserError(f"{task.name}: load_problems({split!r}) returned no problems{hint}")
    # A list is checked whole; a lazy sequence (an Env task's seeds) by its first problem.
    checked = problems if isinstance(problems, list | tuple) else [problems[0]]
    bad = next((p for p in checked if not isinstance(p, dict)), None)
    if bad is not None:
        raise UserError(f"{expected}; one is a {type(bad).__name__}: {bad!r:.80}")
    return problems


def train_problem(problems: Problems, k: int) -> Problem:
    """Problem k of a run (k = step * prompts_per_step + i): the train split in its order, cycling.

    A pure function of k, so a resumed run and both loops draw the same problems. A deep copy: a rollout
    may change its problem, nested values too, without changing another's.
    """
    return copy.deepcopy(problems[k % len(problems)])


def env_test_seeds(num_episodes: int) -> list[int]:
    """The episode seeds of an Env task's first `num_episodes` test problems (what evaluation plays)."""
    from inflight.envs.base import episode_seeds

    return episode_seeds(num_episodes, ENV_TEST_SEED)
