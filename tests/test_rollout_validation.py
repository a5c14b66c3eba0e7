"""What the rollout guard accepts from a task, and how it words and counts what it does not.

A rollout whose reward is NaN or inf, or not a number, or whose metrics hold something that is not a
number, fails like a rollout that raised: counted, logged in one line naming the problem, and fatal only in
numbers (before, one NaN crashed the run in `statistics.pstdev`, a str metric in `statistics.fmean`). A
reward handed to `chat.to_rollout` reaches the guard as given (it once made "1.0" a reward of 1.0), a torch
or numpy scalar as its number. An environment's observation built with a bad field names the field, and a
reward given as text is one. Errors that differ only by an id count as one. And `env.kwargs` are checked
against the environment's annotations when the first environment is built, before any weights load; a
`split` among them, which the run sets, is refused.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import numpy as np
import pytest
import torch
from openenv.core.env_server.types import Observation as OpenEnvObservation
from pydantic import ValidationError

from inflight.config import RolloutConfig, RunConfig
from inflight.envs.base import Environment, State, TextAction, TextObservation
from inflight.errors import UserError, describe
from inflight.orchestrator.guard import RolloutGuard, error_key, rollout_problem
from inflight.orchestrator.task import checked_env_kwargs, make_env
from inflight.rollouts.api import RolloutContext
from inflight.types import Rollout


def rollout(reward: Any = 1.0, metrics: Any = None) -> Rollout:
    return Rollout([1], [True], [0.0], [0], reward=reward, metrics={} if metrics is None else metrics)


def ctx(problem_index: int = 0) -> RolloutContext:
    return RolloutContext(None, None, None, problem_index=problem_index)  # type: ignore[arg-type]


def returning(result: Any) -> Any:
    async def generate_rollout(ctx: RolloutContext, problem: dict) -> Any:
        return result

    return generate_rollout


@pytest.mark.parametrize(
    ("reward", "error"),
    [
        (math.nan, "ValueError: reward is nan: a rollout's reward must be a finite number"),
        (-math.inf, "ValueError: reward is -inf: a rollout's reward must be a finite number"),
        (10**400, "ValueError: reward is inf: a rollout's reward must be a finite number"),
        ("good", "TypeError: reward is a str ('good'), not a number"),
        (None, "TypeError: reward is a NoneType (None), not a number"),
    ],
)
def test_a_reward_that_is_not_a_finite_number_fails_the_rollout(reward: Any, error: str) -> None:
    guard = RolloutGuard(RolloutConfig(max_failed_frac=0.5), min_rollouts=1)
    assert asyncio.run(guard.run(returning(rollout(reward)), ctx(), {})) is None
    assert guard.failed == 1 and dict(guard.errors) == {error: 1}
    with pytest.raises(UserError, match=r"the most common error \(1x\): " + error.split(":")[0]):
        guard.check()


class NoTemplate:
    """The chat format of a session that only makes its Rollout (no turn is formatted)."""

    system_prompt = None

    def with_system_prompt(self, system_prompt: str | None) -> NoTemplate:
        return self


def chat_rollout(reward: Any) -> Rollout:
    return RolloutContext(None, NoTemplate(), None).chat().to_rollout(reward)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("reward", "error"),
    [
        ("1.0", "TypeError: reward is a str ('1.0'), not a number"),
        (None, "TypeError: reward is a NoneType (None), not a number"),
    ],
)
def test_a_chat_reward_that_is_not_a_number_fails_the_rollout_in_the_guards_words(
    reward: Any, error: str
) -> None:
    guard = RolloutGuard(RolloutConfig(max_failed_frac=0.5), min_rollouts=1)
    assert asyncio.run(guard.run(returning(chat_rollout(reward)), ctx(), {})) is None
    assert dict(guard.errors) == {error: 1}


@pytest.mark.parametrize(
    ("reward", "value"),
    [
        (True, 1.0),
        (2, 2.0),
        (0.5, 0.5),
        (np.float32(0.25), 0.25),
        (np.int64(3), 3.0),
        (np.bool_(True), 1.0),
        (np.array(0.75), 0.75),
        (torch.tensor(0.5), 0.5),
        (torch.tensor(2), 2.0),
    ],
)
def test_a_chat_reward_of_any_number_type_trains_as_a_float(reward: Any, value: float) -> None:
    r = chat_rollout(reward)
    assert rollout_problem(r) is None
    assert type(r.reward) is float and r.reward == value


@pytest.mark.parametrize(
    ("metrics", "error"),
    [
        (
            {"label": "yes"},
            "TypeError: metrics['label'] is a str ('yes'), not a number: metrics are averaged; keep other "
            "information out of them",
        ),
        ({"x": None}, "TypeError: metrics['x'] is a NoneType (None), not a number"),
        ({3: 1.0}, "TypeError: metrics key 3 (int) is not a str"),
        ([1.0], "TypeError: metrics is a list, not a dict of numbers"),
    ],
)
def test_a_metric_that_is_not_a_number_fails_the_rollout_naming_it(metrics: Any, error: str) -> None:
    problem = rollout_problem(rollout(0.5, metrics))
    assert problem is not None and problem.startswith(error)


def test_a_usable_rollouts_numbers_become_plain_floats() -> None:
    r = rollout(np.float32(0.5), {"correct": True, "n": np.int64(3), "score": math.nan})
    assert rollout_problem(r) is None
    assert type(r.reward) is float and r.reward == 0.5
    # A NaN metric is kept: metrics are only averaged and logged, and "no value" is a fair thing to log.
    assert r.metrics["correct"] == 1.0 and r.metrics["n"] == 3.0 and math.isnan(r.metrics["score"])
    assert all(type(v) is float for v in r.metrics.values())


def test_one_nan_among_good_rollouts_is_only_counted() -> None:
    guard = RolloutGuard(RolloutConfig(max_failed_frac=0.5), min_rollouts=4)

    async def play() -> list[Rollout | None]:
        results = [returning(rollout(math.nan))] + [returning(rollout(float(i % 2))) for i in range(7)]
        return [await guard.run(fn, ctx(i), {}) for i, fn in enumerate(results)]

    played = asyncio.run(play())
    assert played[0] is None and all(r is not None for r in played[1:])
    guard.check()  # 1 of 8: the run goes on


def test_an_observation_with_a_bad_field_names_it() -> None:
    class BadReward(Environment[TextAction, TextObservation, State]):
        def reset(self, seed: int | None = None, episode_id: str | None = None, **kw: Any) -> TextObservation:
            return TextObservation(prompt="Say yes.")

        def step(self, action: TextAction, timeout_s: float | None = None, **kw: Any) -> TextObservation:
            return TextObservation(prompt="x", done=True, reward="good")  # type: ignore[arg-type]

        @property
        def state(self) -> State:
            return State()

    with pytest.raises(Exception) as e:
        BadReward().step(TextAction(text="yes"))
    assert describe(e.value) == (
        "ValidationError: TextObservation.reward = 'good' (str): a reward is a number (bool, int or float) "
        "or None, not text"
    )
    assert describe(KeyError("answer")) == "KeyError: 'answer'"  # anything else: as before


@pytest.mark.parametrize("reward", ["1", "1.0", b"1"])
def test_an_observation_reward_given_as_text_is_refused(reward: Any) -> None:
    """pydantic's lax mode read "1" as 1.0, and the episode trained on it."""
    with pytest.raises(ValidationError) as e:
        TextObservation(prompt="x", done=True, reward=reward)
    assert describe(e.value).endswith("a reward is a number (bool, int or float) or None, not text")
    observation = TextObservation(prompt="x")
    with pytest.raises(ValidationError):
        observation.reward = reward  # validate_assignment: the same rule
    with pytest.raises(ValidationError):  # from the wire too: OpenEnv sends the reward as a JSON number
        TextObservation.model_validate_json(json.dumps({"prompt": "x", "reward": str(reward)}))


def test_an_observation_reward_of_any_number_type_is_a_float_on_openenvs_wire() -> None:
    rewards = [True, 1, 0.5, np.float32(0.25), np.int64(2), torch.tensor(0.5), None]
    assert [TextObservation(prompt="x", reward=r).reward for r in rewards] == [
        1.0,
        1.0,
        0.5,
        0.25,
        2.0,
        0.5,
        None,
    ]
    assert TextObservation.model_validate_json('{"prompt": "x", "reward": 1}').reward == 1.0
    # The schema OpenEnv's /schema serves is unchanged: a number or null, which its own Observation accepts.
    reward_schema = TextObservation.model_json_schema()["properties"]["reward"]
    assert reward_schema["anyOf"] == [{"type": "number"}, {"type": "null"}]
    wire = TextObservation(prompt="x", done=True, reward=True).model_dump(
        include={"done", "reward", "metadata"}
    )
    assert OpenEnvObservation.model_validate(wire).reward == 1.0


def test_errors_that_differ_only_by_an_id_count_as_one() -> None:
    guard = RolloutGuard(RolloutConfig(max_failed_frac=0.5), min_rollouts=4)
    ids = [
        "e693a6d02f424a368914a278fc59885c",
        "ff7f742571df48799c7f663c9720da49",
        "0a1b2c3d4e5f60718293a4b5c6d7e8f9",
    ]

    def failing(request_id: str) -> Any:
        async def generate_rollout(ctx: RolloutContext, problem: dict) -> Rollout:
            raise ValueError(f"request {request_id}: prompt has 16 tokens, more than the 9 allowed")

        return generate_rollout

    async def play() -> None:
        for request_id in ids:
            await guard.run(failing(request_id), ctx(), {})
        await guard.run(returning(rollout()), ctx(), {})

    asyncio.run(play())
    with pytest.raises(UserError) as e:
        guard.check()
    assert str(e.value).endswith(
        "the most common error (3x): ValueError: request <id>: prompt has 16 tokens, more than the 9 allowed"
    )
    # Ids are set aside: a UUID, a memory address; short hex words stay (numbers are set aside as numbers).
    assert error_key("session 123e4567-e89b-12d3-a456-426614174000 closed") == "session <id> closed"
    assert error_key("<Foo object at 0x7f3a2c1b9d60>") == "<Foo object at <id>>"
    assert (
        error_key("cannot parse problem 12 (deadbeef, cafe42)")
        == "cannot parse problem <n> (deadbeef, cafe42)"
    )


class Guess(Environment[TextAction, TextObservation, State]):
    def __init__(self, low: int = 1, high: int = 10, name: str = "guess", scale: float | None = None) -> None:
        self.low, self.high, self.name, self.scale = low, high, name, scale

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kw: Any) -> TextObservation:
        return TextObservation(prompt=f"{self.low}..{self.high}")

    def step(self, action: TextAction, timeout_s: float | None = None, **kw: Any) -> TextObservation:
        return TextObservation(prompt="ok", done=True, reward=1.0)

    @property
    def state(self) -> State:
        return State()


def test_env_kwargs_of_the_wrong_type_are_refused_in_one_line_naming_the_fix() -> None:
    with pytest.raises(UserError) as e:
        checked_env_kwargs(Guess, {"high": "abc"}, "Guess")
    assert str(e.value) == (
        "env.kwargs.high='abc' is a str, but Guess takes `high: int`: pass a value of that type, e.g. "
        "env.kwargs.high=10 (its default)"
    )
    with pytest.raises(UserError, match=r"takes `scale: float \| None`: pass a value of that type$"):
        checked_env_kwargs(Guess, {"scale": [1]}, "Guess")


def test_env_kwargs_that_say_the_same_thing_in_another_type_are_converted() -> None:
    kwargs = checked_env_kwargs(Guess, {"high": "3", "low": 2.0, "name": 7, "scale": 1}, "Guess")
    assert kwargs == {"high": 3, "low": 2, "name": "7", "scale": 1.0}
    assert type(kwargs["high"]) is int and type(kwargs["scale"]) is float

    def unannotated(level=1, **rest):  # type: ignore[no-untyped-def]
        return Guess()

    assert checked_env_kwargs(unannotated, {"level": "x", "other": object}, "f") == {
        "level": "x",
        "other": object,
    }


def test_make_env_builds_with_the_checked_kwargs() -> None:
    cfg = RunConfig()
    cfg.env.kwargs = {"high": "30"}
    env = make_env(Guess, cfg, "train")
    assert isinstance(env, Guess) and env.high == 30
    cfg.env.kwargs = {"high": "thirty"}
    with pytest.raises(UserError, match=r"^env\.kwargs\.high='thirty' is a str, but Guess takes `high: int`"):
        make_env(Guess, cfg, "train")


class Split(Guess):
    def __init__(self, split: str = "train", high: int = 10) -> None:
        super().__init__(high=high)
        self.split = split


def test_an_env_kwargs_split_the_run_would_overwrite_is_refused() -> None:
    cfg = RunConfig()
    assert make_env(Split, cfg, "test").split == "test"  # the run's split
    cfg.env.kwargs = {"split": "test"}
    with pytest.raises(UserError) as e:
        make_env(Split, cfg, "train")
    assert str(e.value) == (
        'env.kwargs.split=\'test\': Split gets its split from the run ("train" to train on, "test" to '
        "evaluate on), which would overwrite this one: drop env.kwargs.split"
    )
    # An environment that takes no `split` of its own gets none from the run: its kwargs pass as given.
    cfg.env.kwargs = {"high": 5}
    assert make_env(Guess, cfg, "train").high == 5
