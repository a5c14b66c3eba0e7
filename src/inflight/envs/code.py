"""Code as a single-turn text environment: the model writes a Python function, unit tests grade it.

Owns the problem set (`data/code_problems.jsonl`), extracting code from a reply, the test harness and
the reward (the fraction of tests passed); knows nothing of tokens. Each test runs in its own sandbox
process, so a crash, a hang or a hostile trick in one test cannot touch another or the host. A test's
expected value never enters the sandbox: the harness prints the function's result as JSON and the
host compares, so the code cannot fake a pass by printing or exiting early.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import random
import re
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from inflight.envs.base import Environment, State, TextAction, TextObservation
from inflight.envs.sandbox import (
    SandboxLimits,
    SandboxResult,
    Verifier,
    default_pool,
    merge_limits,
    within_time,
)
from inflight.errors import UserError

PROBLEMS_PATH = Path(__file__).parent / "data" / "code_problems.jsonl"
# Per execution (one unit test, one tool call): small programs that finish in well under a second.
DEFAULT_LIMITS = SandboxLimits(wall_s=5.0, cpu_s=5, memory_mb=512, max_output_bytes=65536)
Outcome = Literal["solved", "partial", "failed", "syntax_error", "no_code"]
COUNTERS = (
    "episodes", "solved", "partial", "failed", "syntax_errors", "no_code",
    "tests_run", "tests_passed", "test_timeouts", "sandbox_errors",
)  # fmt: skip
RESULT_MARKER = "@@inflight-test-result@@"
# A fenced block: ```lang ... ``` or one left open at the end of the reply (the model ran out of tokens).
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_LANGS = {"", "python", "py", "python3"}
_CODE_START = re.compile(r"^(?:async\s+def|def|class|import|from|@)\b|^@", re.MULTILINE)
MAX_TRAILING_TRIM_LINES = 20  # unfenced replies: how many trailing prose lines we try dropping
_HARNESS = """\
import json as _json, sys as _sys
_namespace = {{"__name__": "solution"}}
exec(compile({source!r}, "<solution>", "exec"), _namespace)
_result = _namespace[{entry_point!r}](*_json.loads({args!r}))
_sys.stdout.write("\\n" + {marker!r} + _json.dumps(_result) + "\\n")
"""


class CodeTest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    args: list[Any]  # positional arguments, as JSON
    expected: Any  # the JSON value the function must return (tuples compare as lists)


class CodeProblem(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    split: Literal["train", "test"] = "train"  # test: held out from training (recipes evaluate on it)
    entry_point: str = Field(pattern=r"^[A-Za-z_]\w*$")
    signature: str  # e.g. "add(a, b)"
    description: str  # completes "Write a Python function `add(a, b)` that ..."
    solution: str  # a reference solution: the dataset's own check, and warm-up data for recipes
    tests: list[CodeTest] = Field(min_length=1)

    @property
    def prompt(self) -> str:
        return (
            f"Write a Python function `{self.signature}` that {self.description}.\n"
            "Reply with the function in a ```python code block."
        )


@functools.cache
def load_problems(path: Path = PROBLEMS_PATH) -> tuple[CodeProblem, ...]:
    """The problems of a JSONL file, one CodeProblem per line; errors name the line."""
    if not path.is_file():
        raise UserError(f"code problems file {path} not found")
    problems = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                problems.append(CodeProblem.model_validate_json(line))
            except ValidationError as e:
                raise UserError(f"{path}:{number}: not a code problem: {e}") from None
    if not problems:
        raise UserError(f"code problems file {path} holds no problems")
    return tuple(problems)


def extract_code(text: str) -> str | None:
    """The Python code of a reply, or None if it has none.

    Fenced replies: the last Python (or unlabelled) block that defines a function, else all Python
    blocks joined. Unfenced: from the first line that starts code (def, class, import, from, @) on,
    dropping trailing lines of prose while that makes it compile.
    """
    blocks = [textwrap.dedent(body) for lang, body in _FENCE.findall(text) if lang.lower() in _PYTHON_LANGS]
    if blocks:
        defining = [block for block in blocks if re.search(r"^\s*(async\s+)?def\s", block, re.MULTILINE)]
        code = (defining[-1] if defining else "\n".join(blocks)).strip("\n")
        return code or None
    start = _CODE_START.search(text)
    if start is None:
        return None
    lines = text[start.start() :].rstrip().splitlines()
    for end in range(len(lines), max(len(lines) - MAX_TRAILING_TRIM_LINES, 0), -1):
        if syntax_error("\n".join(lines[:end])) is None:
            return "\n".join(lines[:end])
    return "\n".join(lines)  # it does not compile: the caller reports the syntax error


def syntax_error(code: str) -> str | None:
    """The compiler's complaint about `code`, or None. Compiling parses only; nothing runs."""
    try:
        compile(code, "<solution>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def harness_program(code: str, entry_point: str, test: CodeTest) -> str:
    """The program one sandbox runs for one test. The solution runs as module `solution`, so an
    `if __name__ == "__main__":` block in it does not."""
    args = json.dumps(test.args)
    return _HARNESS.format(source=code, entry_point=entry_point, args=args, marker=RESULT_MARKER)


def check_result(result: SandboxResult, expected: Any) -> bool:
    """Whether a test's run printed a result equal to `expected` (floats to a relative 1e-9)."""
    if not result.ok:
        return False
    lines = [line for line in result.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if not lines:
        return False
    try:
        actual = json.loads(lines[-1].removeprefix(RESULT_MARKER))
    except ValueError:
        return False
    return _equal(actual, expected)


def _equal(actual: Any, expected: Any) -> bool:
    if isinstance(expected, bool) or isinstance(actual, bool):
        return type(actual) is type(expected) and actual == expected
    if isinstance(expected, int | float) and isinstance(actual, int | float):
        try:
            return math.isclose(actual, expected, rel_tol=1e-9, abs_tol=1e-12)
        except OverflowError:  # an int beyond float range (e.g. 10**400): only exact equality matches
            return bool(actual == expected)
    if isinstance(expected, list) and isinstance(actual, list):
        return len(actual) == len(expected) and all(map(_equal, actual, expected))
    if isinstance(expected, dict) and isinstance(actual, dict):
        return actual.keys() == expected.keys() and all(_equal(actual[k], expected[k]) for k in expected)
    return bool(actual == expected)


class CodeObservation(TextObservation):
    """The task; once done, `prompt` reports the test results."""

    problem_id: str
    entry_point: str
    num_tests: int
    tests_passed: int | None = None  # set once done
    outcome: Outcome | None = None
    failure: str | None = None  # once done: why the first failing test failed (or the syntax error)


class CodeState(State):
    seed: int | None = None
    problem_id: str = ""
    outcome: Outcome | None = None


class CodeEnv(Environment[TextAction, CodeObservation, CodeState]):
    """One problem per episode and one reply; reward = fraction of the problem's tests passed.

    A reply without code or with a syntax error earns 0 and runs nothing. `step_async` grades without
    blocking an event loop; `step` blocks its thread. A step's `timeout_s` (the seconds its episode has
    left) caps every test's wall_s. The verifier pool is shared across instances.
    `split` picks the problems: the set's train or held-out test problems (every fifth), or all of them.
    """

    def __init__(
        self,
        *,
        split: Literal["train", "test", "all"] = "all",
        problems_path: str | Path | None = None,
        limits: SandboxLimits | dict[str, Any] | None = None,  # a dict comes from a run config
        pool: Verifier | None = None,
        seed: int | None = None,
    ) -> None:
        if split not in ("train", "test", "all"):
            raise UserError(f"unknown code split {split!r}; choose train, test or all")
        problems = load_problems(Path(problems_path) if problems_path else PROBLEMS_PATH)
        self.problems = tuple(p for p in problems if split in ("all", p.split))
        if not self.problems:
            raise UserError(f"the code problem set has no {split!r} problems")
        self.limits = merge_limits(DEFAULT_LIMITS, limits)
        self._pool = pool
        self._seeds = random.Random(seed)
        self._problem: CodeProblem | None = None
        self._state = CodeState()
        self._counters = dict.fromkeys(COUNTERS, 0)

    @property
    def pool(self) -> Verifier:
        if self._pool is None:
            self._pool = default_pool()  # created on first use: building the env starts no sandbox
        return self._pool

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        problem_id: str | None = None,
        **kwargs: Any,
    ) -> CodeObservation:
        """Pick the problem from `seed` (the same seed, the same problem), or by `problem_id`."""
        if kwargs:
            raise UserError(f"CodeEnv.reset got unknown arguments {sorted(kwargs)}; use seed, problem_id")
        if seed is None:
            seed = self._seeds.getrandbits(63)
        if problem_id is not None:
            by_id = {p.id: p for p in self.problems}
            if problem_id not in by_id:
                raise UserError(f"unknown code problem {problem_id!r}; known: {', '.join(sorted(by_id))}")
            problem = by_id[problem_id]
        else:
            problem = self.problems[random.Random(seed).randrange(len(self.problems))]
        self._problem = problem
        self._state = CodeState(episode_id=episode_id, seed=seed, problem_id=problem.id)
        self._counters["episodes"] += 1
        return CodeObservation(
            prompt=problem.prompt,
            problem_id=problem.id,
            entry_point=problem.entry_point,
            num_tests=len(problem.tests),
        )

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs: Any) -> CodeObservation:
        problem, code, error = self._prepare(action)
        if error is not None:
            return self._finish(problem, [], error)
        programs = [harness_program(code, problem.entry_point, t) for t in problem.tests]
        results = self.pool.run_many(programs, limits=within_time(self.limits, timeout_s))
        return self._finish(problem, results, None)

    async def step_async(
        self, action: TextAction, timeout_s: float | None = None, **kwargs: Any
    ) -> CodeObservation:
        problem, code, error = self._prepare(action)
        if error is not None:
            return self._finish(problem, [], error)
        limits = within_time(self.limits, timeout_s)
        runs = [
            self.pool.run(harness_program(code, problem.entry_point, t), limits=limits) for t in problem.tests
        ]
        return self._finish(problem, list(await asyncio.gather(*runs)), None)

    @property
    def state(self) -> CodeState:
        return self._state.model_copy()

    @property
    def counters(self) -> dict[str, int]:
        return dict(self._counters)

    def _prepare(self, action: TextAction) -> tuple[CodeProblem, str, tuple[Outcome, str] | None]:
        problem = self._problem
        if problem is None or self._state.outcome is not None:
            raise RuntimeError("CodeEnv.step called before reset() or after the reply was graded")
        code = extract_code(action.text)
        if code is None:
            return problem, "", ("no_code", "the reply contains no Python code")
        if (error := syntax_error(code)) is not None:
            return problem, code, ("syntax_error", error)
        return problem, code, None

    def _finish(
        self, problem: CodeProblem, results: Sequence[SandboxResult], error: tuple[Outcome, str] | None
    ) -> CodeObservation:
        passed = [check_result(r, t.expected) for r, t in zip(results, problem.tests, strict=False)]
        total = len(problem.tests)
        failure: str | None
        if error is not None:
            outcome, failure = error
        else:
            outcome = "solved" if all(passed) else "partial" if any(passed) else "failed"
            failure = next(
                (_describe_failure(problem, i, r) for i, r in enumerate(results) if not passed[i]), None
            )
        counts = {"tests_run": len(results), "tests_passed": sum(passed)}
        counts |= {"test_timeouts": sum(r.reason == "timeout" for r in results)}
        counts |= {"sandbox_errors": sum(r.reason == "sandbox_error" for r in results)}
        counter = {"syntax_error": "syntax_errors"}.get(outcome, outcome)
        for name, value in {counter: 1, **counts}.items():
            self._counters[name] += value
        self._state.step_count += 1
        self._state.outcome = outcome
        if error is not None:
            verdict = f"No tests run ({outcome.replace('_', ' ')}): {failure}"
        else:
            verdict = f"{sum(passed)}/{total} tests passed." + (
                f" First failure: {failure}" if failure else ""
            )
        return CodeObservation(
            prompt=verdict,
            problem_id=problem.id,
            entry_point=problem.entry_point,
            num_tests=total,
            tests_passed=sum(passed),
            outcome=outcome,
            failure=failure,
            done=True,
            reward=sum(passed) / total,
            metadata={
                "solved": int(outcome == "solved"),
                "syntax_error": int(outcome == "syntax_error"),
                "no_code": int(outcome == "no_code"),
                "format_error": int(error is not None),
                "tests_total": total,
                **counts,
            },
        )


def _describe_failure(problem: CodeProblem, index: int, result: SandboxResult) -> str:
    test = problem.tests[index]
    call = f"{problem.entry_point}({', '.join(map(json.dumps, test.args))})"
    if result.ok:
        return f"{call} should return {json.dumps(test.expected)}"
    last = result.stderr.strip().splitlines()[-1:] or [f"exit code {result.exit_code}"]
    return f"{call} failed ({result.reason}): {last[0][:200]}"
