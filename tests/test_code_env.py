"""The `code` environment: problems, code extraction, grading in the sandbox, and reward hacking.

References: the problem set's own reference solutions (each must pass all its tests in the sandbox:
that checks the hand-written expected values against independent code), and the HumanEval/MBPP
convention of reward = fraction of unit tests passed.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import LimitsSeen
from inflight.envs import TextAction, make_env
from inflight.envs.code import RESULT_MARKER, CodeEnv, extract_code, load_problems
from inflight.envs.sandbox import SandboxLimits, VerifierPool, bwrap_problem
from inflight.errors import UserError

PROBLEMS = load_problems()


@pytest.fixture(scope="module")
def pool() -> Iterator[VerifierPool]:
    if os.environ.get("CI") and (problem := bwrap_problem()):
        pytest.fail(f"bubblewrap must work in CI: {problem}")
    if os.geteuid() != 0 and bwrap_problem():
        pytest.skip("no bwrap and not root: rlimit mode would run code as the test runner")
    with VerifierPool(concurrency=2) as pool:
        yield pool


@pytest.fixture
def env(pool: VerifierPool) -> CodeEnv:
    return CodeEnv(pool=pool, limits=SandboxLimits(wall_s=5, cpu_s=3))


def fenced(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}\n```\nIt should work."


def test_every_reference_solution_passes_all_its_tests(env: CodeEnv) -> None:
    failures = {}
    for problem in PROBLEMS:
        env.reset(problem_id=problem.id)
        obs = env.step(TextAction(text=fenced(problem.solution)))
        if obs.reward != 1.0:
            failures[problem.id] = obs.prompt
    assert failures == {}
    counters = env.counters
    assert counters["solved"] == len(PROBLEMS) and counters["tests_run"] == sum(
        len(p.tests) for p in PROBLEMS
    )


def test_the_problem_set_is_well_formed() -> None:
    assert len(PROBLEMS) >= 30 and len({p.id for p in PROBLEMS}) == len(PROBLEMS)
    for p in PROBLEMS:
        assert p.signature.startswith(p.entry_point + "(") and f"def {p.entry_point}(" in p.solution


def test_reset_picks_the_problem_from_the_seed(env: CodeEnv) -> None:
    first = [env.reset(seed=s).problem_id for s in range(40)]
    again = [env.reset(seed=s).problem_id for s in range(40)]
    assert first == again and len(set(first)) > 10
    obs = env.reset(seed=3)
    problem = next(p for p in PROBLEMS if p.id == obs.problem_id)
    assert problem.signature in obs.prompt and problem.description in obs.prompt
    assert (obs.entry_point, obs.num_tests, obs.done, obs.reward) == (
        problem.entry_point,
        len(problem.tests),
        False,
        None,
    )


def test_reward_is_the_fraction_of_tests_passed(env: CodeEnv) -> None:
    problem = next(p for p in PROBLEMS if p.id == "is_even")
    env.reset(problem_id="is_even")
    obs = env.step(TextAction(text=fenced("def is_even(n):\n    return True")))
    expected_true = sum(t.expected is True for t in problem.tests)
    assert 0 < expected_true < len(problem.tests)
    assert obs.done and obs.reward == expected_true / len(problem.tests)
    assert (obs.outcome, obs.tests_passed) == ("partial", expected_true)
    assert obs.failure is not None and "should return false" in obs.failure
    assert obs.metadata["tests_passed"] == expected_true and obs.metadata["solved"] == 0


def test_replies_without_valid_code_run_nothing(env: CodeEnv, pool: VerifierPool) -> None:
    submitted = pool.stats()["submitted"]
    env.reset(problem_id="add")
    no_code = env.step(TextAction(text="I am not sure how to do that."))
    env.reset(problem_id="add")
    broken = env.step(TextAction(text=fenced("def add(a, b) return a + b")))
    assert (no_code.outcome, no_code.reward, no_code.metadata["format_error"]) == ("no_code", 0.0, 1)
    assert (broken.outcome, broken.reward, broken.metadata["syntax_error"]) == ("syntax_error", 0.0, 1)
    assert broken.failure is not None and "SyntaxError" in broken.failure
    assert pool.stats()["submitted"] == submitted
    assert (env.counters["no_code"], env.counters["syntax_errors"]) == (1, 1)


@pytest.mark.parametrize(
    "solution",
    [
        "import os\nos._exit(0)\ndef add(a, b):\n    return 0",  # exit "successfully" before any test
        "import sys\nsys.exit(0)",
        f"print({RESULT_MARKER!r} + '3')\ndef add(a, b):\n    return -1",  # print a fake result first
        "import atexit\natexit.register(lambda: print('3'))\ndef add(a, b):\n    return None",
        "def add(a, b):\n    while True:\n        pass",  # hang: each test times out
        "def add(a, b):\n    return {a, b}",  # not JSON: fails, does not crash the grader
    ],
    ids=["os_exit", "sys_exit", "fake_marker", "atexit", "hang", "unserialisable"],
)
def test_reward_hacks_and_hangs_earn_nothing(pool: VerifierPool, solution: str) -> None:
    env = CodeEnv(pool=pool, limits=SandboxLimits(wall_s=1.5, cpu_s=1))
    env.reset(problem_id="add")
    obs = env.step(TextAction(text=fenced(solution)))
    assert (obs.done, obs.reward, obs.outcome) == (True, 0.0, "failed"), obs.prompt


def test_a_main_block_in_the_reply_does_not_run(env: CodeEnv) -> None:
    code = "def add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    print(add(int(input()), 1))"
    env.reset(problem_id="add")
    assert env.step(TextAction(text=fenced(code))).reward == 1.0


def test_step_async_grades_like_step(env: CodeEnv) -> None:
    env.reset(problem_id="fizzbuzz")
    obs = asyncio.run(
        env.step_async(TextAction(text=fenced(next(p.solution for p in PROBLEMS if p.id == "fizzbuzz"))))
    )
    assert (obs.reward, obs.outcome) == (1.0, "solved")


def test_step_outside_an_episode_is_an_error(env: CodeEnv) -> None:
    with pytest.raises(RuntimeError, match="before reset"):
        env.step(TextAction(text="x"))
    env.reset(problem_id="add")
    env.step(TextAction(text="nothing"))
    with pytest.raises(RuntimeError, match="after the reply was graded"):
        env.step(TextAction(text="again"))


def test_registry_and_bad_inputs(tmp_path: Path) -> None:
    assert isinstance(make_env("code"), CodeEnv)
    with pytest.raises(UserError, match="unknown code problem 'nope'"):
        CodeEnv().reset(problem_id="nope")
    bad = tmp_path / "problems.jsonl"
    bad.write_text('{"id": "x", "entry_point": "f"}\n')
    with pytest.raises(UserError, match=r"problems.jsonl:1: not a code problem"):
        CodeEnv(problems_path=bad)


@pytest.mark.parametrize(
    ("reply", "code"),
    [
        ("```python\ndef f():\n    return 1\n```", "def f():\n    return 1"),
        ("Sure!\n```\ndef f():\n    return 1\n```\nDone.", "def f():\n    return 1"),
        ("```py\ndef f():\n    return 1", "def f():\n    return 1"),  # unterminated: ran out of tokens
        ("Use:\n```bash\nrm -rf /\n```\n```python\nx = 1\n```", "x = 1"),  # non-Python blocks ignored
        (
            "```python\ndef f():\n    return 1\n```\nExample:\n```python\nprint(f())\n```",
            "def f():\n    return 1",
        ),  # the block that defines a function, not the usage example
        (
            "1. Code:\n   ```python\n   def f():\n       return 1\n   ```",
            "def f():\n    return 1",
        ),  # indented
        ("The answer:\ndef f():\n    return 1\nThis returns one.", "def f():\n    return 1"),  # unfenced
        ("import math\ndef f():\n    return math.pi", "import math\ndef f():\n    return math.pi"),
        ("I cannot help with that.", None),
        ("```python\n```", None),
    ],
)
def test_extract_code(reply: str, code: str | None) -> None:
    assert extract_code(reply) == code


@pytest.mark.parametrize("asynchronous", [False, True])
def test_no_test_runs_past_the_time_its_episode_has_left(asynchronous: bool) -> None:
    pool = LimitsSeen()
    env = CodeEnv(pool=pool, limits=SandboxLimits(wall_s=5, cpu_s=3))
    reply = TextAction(text=fenced("def add(a, b):\n    return a + b"))
    walls = []
    for timeout_s in (None, 0.5, 60.0):  # none given, less than wall_s, more
        env.reset(problem_id="add")
        pool.limits.clear()
        if asynchronous:
            asyncio.run(env.step_async(reply, timeout_s=timeout_s))
        else:
            env.step(reply, timeout_s=timeout_s)
        walls.append({limits.wall_s if limits else None for limits in pool.limits})
    assert walls == [{5.0}, {0.5}, {5.0}]
