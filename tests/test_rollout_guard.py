"""The fault-tolerance boundary around a task's `generate_rollout`, and the Task helpers the loops rely on,
with hand-written fake rollout functions (no model).

Reference: issue 14 "Bad input": a rollout that raises, returns the wrong type or hangs is counted, logged
with its phase, its problem index and the exception's first line, bounded by `rollout.timeout_s`, and the
run goes on; more than `rollout.max_failed_frac` failed stops the run naming the most common error. And
item 2: problem k of a run is the k-th train problem, cycling, each rollout playing its own deep copy of
it (docs/bring-your-own-task.md); an Env task's test split is fixed episode seeds.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from inflight.config import RolloutConfig, RunConfig
from inflight.envs.base import episode_seeds
from inflight.envs.math import MathEnv
from inflight.errors import UserError
from inflight.orchestrator.guard import LOGGED_PER_ERROR, GuardCounts, RolloutGuard
from inflight.orchestrator.rollout_group import play_group
from inflight.orchestrator.task import ENV_TEST_SEED, Task, env_task, make_env, train_problem
from inflight.rollouts.api import RolloutContext
from inflight.types import Rollout

GUARD_LOGGER = "inflight.orchestrator.guard"


def ctx(problem_index: int = 0, sample_index: int = 0) -> RolloutContext:
    async def never(request: Any) -> Any:
        raise AssertionError("the fake rollouts never call the policy")

    return RolloutContext(never, None, None, problem_index=problem_index, sample_index=sample_index)  # type: ignore[arg-type]


def rollout(reward: float = 1.0) -> Rollout:
    return Rollout(token_ids=[1], loss_mask=[True], logprobs=[0.0], versions=[0], reward=reward)


def run(guard: RolloutGuard, fn: Any, problem_index: int = 0) -> Rollout | None:
    return asyncio.run(guard.run(fn, ctx(problem_index), {}))


async def good(ctx: RolloutContext, problem: dict) -> Rollout:
    return rollout()


async def raises(ctx: RolloutContext, problem: dict) -> Rollout:
    raise ValueError("no answer in the reply\n  (a second line of the message)")


async def wrong_type(ctx: RolloutContext, problem: dict) -> Rollout:
    return {"reward": 1.0}  # type: ignore[return-value]


async def hangs(ctx: RolloutContext, problem: dict) -> Rollout:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def own_timeout(ctx: RolloutContext, problem: dict) -> Rollout:
    raise TimeoutError("the remote environment did not answer")


def test_each_failure_is_counted_logged_with_its_problem_and_the_run_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    guard = RolloutGuard(RolloutConfig(timeout_s=0.05, max_failed_frac=1.0), min_rollouts=1)
    with caplog.at_level(logging.WARNING, logger=GUARD_LOGGER):
        assert run(guard, good) is not None
        assert run(guard, raises, problem_index=3) is None
        assert run(guard, wrong_type, problem_index=4) is None
        assert run(guard, hangs, problem_index=5) is None
        assert run(guard, own_timeout, problem_index=6) is None
    assert (guard.attempted, guard.failed, guard.timeouts) == (5, 4, 1)
    assert guard.metrics() == {"rollout_errors": 4.0, "rollout_timeouts": 1.0}
    # Only the guard's: another library's thread (a leaked SDK client's heartbeat) may log meanwhile.
    messages = [r.getMessage() for r in caplog.records if r.name == GUARD_LOGGER]
    assert messages == [
        "rollout failed (training): problem 3, sample 0: ValueError: no answer in the reply",  # first line
        "rollout failed (training): problem 4, sample 0: TypeError: generate_rollout returned a dict, not a "
        "Rollout",
        "rollout failed (training): problem 5, sample 0: TimeoutError: generate_rollout ran past "
        "rollout.timeout_s=0.05 s",
        "rollout failed (training): problem 6, sample 0: TimeoutError: the remote environment did not answer",
    ]
    guard.check()  # max_failed_frac=1: never stops


def test_the_same_error_is_logged_a_few_times_then_only_counted(caplog: pytest.LogCaptureFixture) -> None:
    guard = RolloutGuard(RolloutConfig(max_failed_frac=1.0), min_rollouts=1)
    with caplog.at_level(logging.WARNING, logger=GUARD_LOGGER):
        for k in range(LOGGED_PER_ERROR + 3):
            run(guard, raises, problem_index=k)
    records = [r for r in caplog.records if r.name == GUARD_LOGGER]
    assert guard.failed == LOGGED_PER_ERROR + 3 and len(records) == LOGGED_PER_ERROR
    assert "counted, not logged" in records[-1].getMessage()


def test_too_many_failures_stop_the_run_naming_the_most_common_error() -> None:
    guard = RolloutGuard(RolloutConfig(max_failed_frac=0.5), min_rollouts=8)
    for fn in (raises, raises, raises, wrong_type, good, good, good):
        run(guard, fn)
    guard.check()  # 4 of 7 failed, but fewer than min_rollouts were tried: not judged yet
    run(guard, good)
    guard.check()  # 4 of 8: not more than half
    run(guard, raises)
    with pytest.raises(UserError) as e:
        guard.check()
    assert str(e.value) == (
        "stopped: 5 of 9 rollouts failed, more than rollout.max_failed_frac=0.5; the most common error "
        "(4x): ValueError: no answer in the reply"
    )


def test_a_cancellation_passes_through_uncounted() -> None:
    guard = RolloutGuard(RolloutConfig(), min_rollouts=1)

    async def cancel_it() -> None:
        task = asyncio.create_task(guard.run(hangs, ctx(), {}))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_it())
    assert guard.failed == 0


def test_train_problem_k_cycles_through_the_train_split_and_is_a_copy() -> None:
    problems = [{"i": 0, "seen": {"n": 0}}, {"i": 1, "seen": {"n": 0}}, {"i": 2, "seen": {"n": 0}}]
    assert [train_problem(problems, k)["i"] for k in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    train_problem(problems, 0)["i"] = 99
    train_problem(problems, 0)["seen"]["n"] += 1  # nested: a shallow copy would share it
    assert problems[0] == {"i": 0, "seen": {"n": 0}}


def test_each_rollout_of_a_group_gets_its_own_deep_copy_of_its_problem() -> None:
    """A rollout that pops its answer or counts in a nested dict changes no other sample's problem, nor the
    problem a later step plays again."""
    seen: list[tuple[str, int]] = []

    async def mutates(ctx: RolloutContext, problem: dict) -> Rollout:
        seen.append((problem.pop("answer"), problem["tries"]["n"]))
        problem["tries"]["n"] += 1
        return rollout()

    cfg = RunConfig.model_validate({"grpo": {"group_size": 4}})
    task = Task("fake", load_problems=lambda split: [], generate_rollout=mutates)
    problem = {"answer": "42", "tries": {"n": 0}}
    guard = RolloutGuard(cfg.rollout, min_rollouts=1)
    for _ in range(2):  # the same problem again: a later step's
        group = asyncio.run(play_group(task, problem, 0, cfg, None, ctx().generate_fn, guard))  # type: ignore[arg-type]
        assert len(group.rollouts) == 4
    assert guard.failed == 0 and seen == [("42", 0)] * 8
    assert problem == {"answer": "42", "tries": {"n": 0}}


def test_an_env_tasks_splits_are_seeds() -> None:
    task = env_task("math", MathEnv)
    train, test = task.load_problems("train"), task.load_problems("test")
    assert [train[k]["seed"] for k in range(4)] == [0, 1, 2, 3]  # the sync loop's seeds for run seed 0
    assert [test[i]["seed"] for i in range(50)] == episode_seeds(50, ENV_TEST_SEED)  # the old eval hands
    assert test[3] == {"seed": test[3]["seed"], "split": "test"} and train[:2][1]["seed"] == 1
    with pytest.raises(ValueError, match="'train' and 'test'"):
        task.load_problems("validation")


def test_an_env_that_takes_a_split_gets_it_and_env_name_replaces_the_tasks_env() -> None:
    cfg = RunConfig()
    train = make_env(MathEnv, cfg, "train")
    test = make_env(MathEnv, cfg, "test")
    assert {p.split for p in train.problems} == {"train"} and {p.split for p in test.problems} == {"test"}
    cfg.env.name = "arithmetic"
    assert type(make_env(MathEnv, cfg, "train")).__name__ == "ArithmeticEnv"


def test_counts_taken_in_one_guard_add_up_in_another() -> None:
    """A rollout worker's guard reports what it counted since its last report (`take_counts`); the run's
    guard adds it (`absorb`) and judges the sum: nothing counted twice, nothing lost between reports."""
    worker = RolloutGuard(RolloutConfig(timeout_s=0.05, max_failed_frac=0.5), min_rollouts=1)
    run = RolloutGuard(RolloutConfig(max_failed_frac=0.5), min_rollouts=4)

    async def ok(ctx, problem):  # type: ignore[no-untyped-def]
        return rollout()

    async def boom(ctx, problem):  # type: ignore[no-untyped-def]
        raise ValueError("bad env")

    async def slow(ctx, problem):  # type: ignore[no-untyped-def]
        await asyncio.sleep(1)

    async def play(*fns):  # type: ignore[no-untyped-def]
        for fn in fns:
            await worker.run(fn, ctx(), {})

    asyncio.run(play(ok, boom))
    first = worker.take_counts()
    assert (first.attempted, first.failed, first.timeouts, first.errors) == (
        2,
        1,
        0,
        {"ValueError: bad env": 1},
    )
    asyncio.run(play(boom, slow, ok))
    second = worker.take_counts()
    timeout = f"TimeoutError: generate_rollout ran past rollout.timeout_s={0.05:g} s"
    assert (second.attempted, second.failed, second.timeouts) == (3, 2, 1)
    assert second.errors == {"ValueError: bad env": 1, timeout: 1}
    assert worker.take_counts() == GuardCounts()  # nothing new since
    run.absorb(first)
    run.check()  # 1 of 2: too few tried to judge
    run.absorb(second)
    assert run.metrics() == {"rollout_errors": 3.0, "rollout_timeouts": 1.0}
    with pytest.raises(UserError, match=r"3 of 5 rollouts failed.*\(2x\): ValueError: bad env"):
        run.check()


def test_errors_that_quote_generated_text_count_as_one_cause_quoted_short() -> None:
    """A QA pass: "the most common error (1x)" when every failure quoted its own reply (each message unique),
    and a whole pydantic error list quoted. Counted by cause now (quoted text and numbers set aside), the
    first message of it quoted, cut to 200 characters; a quoted name (a missing key) still tells two
    causes apart."""
    guard = RolloutGuard(RolloutConfig(max_failed_frac=0.5), min_rollouts=4)
    replies = ["the answer is 5", "I'd say 12", "y" * 1000, 'say "7"']

    def no_integer(reply: str) -> Any:
        async def generate_rollout(ctx: RolloutContext, problem: dict) -> Rollout:
            raise ValueError(f"no integer in reply {reply!r} after {len(reply)} chars")

        return generate_rollout

    for reply in replies:
        run(guard, no_integer(reply))
    with pytest.raises(UserError) as e:
        guard.check()
    assert str(e.value).endswith(
        "the most common error (4x): ValueError: no integer in reply 'the answer is 5' after 15 chars"
    )

    long_first = RolloutGuard(RolloutConfig(max_failed_frac=0.5), min_rollouts=2)
    for reply in ("y" * 1000, "short"):
        run(long_first, no_integer(reply))
    with pytest.raises(UserError) as e:
        long_first.check()
    quoted = str(e.value).split("the most common error (2x): ")[1]  # cut to guard.SHOWN_ERROR_CHARS
    assert len(quoted) == 200 and quoted.startswith("ValueError: no integer in reply 'yyy")
    assert quoted.endswith("y…")

    async def missing(ctx: RolloutContext, problem: dict) -> Rollout:
        raise KeyError("answer" if ctx.problem_index % 2 else "question")

    keys = RolloutGuard(RolloutConfig(max_failed_frac=1.0), min_rollouts=1)
    for i in range(4):
        run(keys, missing, problem_index=i)
    assert dict(keys.errors) == {"KeyError: 'question'": 2, "KeyError: 'answer'": 2}


def test_a_workers_counts_join_the_run_guards_cause_under_its_first_message() -> None:
    """Each rollout worker's guard quotes its own first message of a cause (cut to 200 characters, which
    may cut what tells its cause): the run's guard adds them to the one cause, not one entry per worker."""

    def no_integer(reply: str) -> Any:
        async def generate_rollout(ctx: RolloutContext, problem: dict) -> Rollout:
            raise ValueError(f"no integer in reply {reply!r} after {len(reply)} chars")

        return generate_rollout

    run_guard = RolloutGuard(RolloutConfig(max_failed_frac=0.5), min_rollouts=3)
    for replies in (["z" * 500], ["five", "a dozen"]):
        worker = RolloutGuard(RolloutConfig(), min_rollouts=1)
        for reply in replies:
            run(worker, no_integer(reply))
        run_guard.absorb(worker.take_counts())
    [(first, count)] = run_guard.errors.items()
    assert count == 3 and first.startswith("ValueError: no integer in reply 'zzz") and first.endswith("z…")
