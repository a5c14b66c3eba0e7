"""Math word and LaTeX problems as a single-turn text environment, answers checked with `math-verify`.

Owns the in-repo problem set (`envs/data/math_problems.jsonl`, written for this project: short problems
with LaTeX answers such as `\\frac{1}{2}` or `3\\sqrt{2}`), the prompt and the verdict; knows nothing of
tokens. Seed i poses problem i mod the split's size, so a run cycles through the split in order.
"""

from __future__ import annotations

import logging
import random
import threading
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from inflight.envs.base import Environment, State, TextAction, TextObservation
from inflight.errors import UserError

Split = Literal["train", "test", "all"]
Outcome = Literal["correct", "wrong", "format_error"]
COUNTERS = ("problems", "correct", "wrong", "format_errors")
INSTRUCTION = "Put your final answer in \\boxed{}."
MAX_REPLY_CHARS = 2_000  # longer replies are format errors unparsed: sympy time grows with the text
PARSE_TIMEOUT_S = 5  # math-verify's own per-call limit (signal.alarm, main thread only)


class MathProblem(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    split: Literal["train", "test"]
    problem: str  # LaTeX inline, without $ delimiters
    answer: str  # LaTeX, without $ delimiters, e.g. "3\\sqrt{2}"


def default_problems_path() -> Path:
    return Path(str(resources.files("inflight.envs").joinpath("data/math_problems.jsonl")))


@cache
def load_problems(path: str | None = None) -> tuple[MathProblem, ...]:
    """Every problem of a JSONL file (default: the in-repo set), validated; cached per path."""
    file = Path(path) if path else default_problems_path()
    if not file.is_file():
        raise UserError(f"math problem file {file} does not exist")
    problems = []
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            problems.append(MathProblem.model_validate_json(line))
        except ValidationError as e:
            raise UserError(f"{file}:{n}: not a math problem ({e.errors()[0]['msg']}): {line[:80]}") from None
    if len({p.id for p in problems}) != len(problems):
        raise UserError(f"{file}: problem ids must be unique")
    return tuple(problems)


def _timeout_s() -> int | None:
    # math-verify times out with signal.alarm, which only the main thread may set; elsewhere (an HTTP
    # server's worker thread) it runs unbounded, and MAX_REPLY_CHARS bounds the work instead.
    return PARSE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


class _NoTimeoutNotice(logging.Filter):
    """Drops math-verify's "Timeout is disabled ..." warning, which it logs where `_timeout_s` passes no
    timeout, on purpose (a worker thread: MAX_REPLY_CHARS bounds the work). Every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


_NO_TIMEOUT_NOTICE = _NoTimeoutNotice()
for _module in ("math_verify.parser", "math_verify.grader"):  # the two that log it; their loggers by name
    logging.getLogger(_module).addFilter(_NO_TIMEOUT_NOTICE)


def parse_reply(text: str) -> list[Any]:
    """math-verify's parse of a reply (a \\boxed{} answer first, else the last LaTeX or plain expression);
    empty when nothing parses, or the reply is over MAX_REPLY_CHARS."""
    from math_verify import parse  # sympy is slow to import: only when a reply is judged

    if len(text) > MAX_REPLY_CHARS:
        return []
    return list(parse(text, parsing_timeout=_timeout_s()))  # type: ignore[arg-type]


def is_correct(gold_latex: str, reply: list[Any]) -> bool:
    """Whether a parsed reply equals the gold answer (math-verify: symbolic and numeric equivalence)."""
    from math_verify import parse, verify

    gold = parse(f"${gold_latex}$", parsing_timeout=_timeout_s())  # type: ignore[arg-type]
    if not gold:
        raise UserError(f"gold answer {gold_latex!r} does not parse: fix the problem file")
    return bool(verify(gold, reply, timeout_seconds=_timeout_s()))


class MathObservation(TextObservation):
    problem_id: str
    outcome: Outcome | None = None
    answer: str | None = None  # revealed once done


class MathState(State):
    problem_id: str | None = None
    answer: str | None = None  # hidden from the policy while the episode is live
    outcome: Outcome | None = None


class MathEnv(Environment[TextAction, MathObservation, MathState]):
    """One problem per episode, one reply: reward 1 when math-verify finds the reply equal to the answer,
    0 when not, `format_penalty` when nothing in it parses as math."""

    def __init__(
        self,
        split: Split = "train",
        path: str | None = None,
        format_penalty: float = 0.0,
        seed: int | None = None,
    ) -> None:
        if split not in ("train", "test", "all"):
            raise UserError(f"unknown math split {split!r}; choose train, test or all")
        self.problems = [p for p in load_problems(path) if split in ("all", p.split)]
        if not self.problems:
            raise UserError(f"the math problem set has no {split!r} problems")
        self.format_penalty = format_penalty
        self._seeds = random.Random(seed)
        self._problem: MathProblem | None = None
        self._state = MathState()
        self._counters = dict.fromkeys(COUNTERS, 0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> MathObservation:
        if kwargs:
            raise UserError(f"MathEnv.reset got unknown arguments {sorted(kwargs)}; use seed")
        if seed is None:
            seed = self._seeds.getrandbits(63)
        self._problem = problem = self.problems[seed % len(self.problems)]
        self._state = MathState(episode_id=episode_id, problem_id=problem.id, answer=problem.answer)
        self._counters["problems"] += 1
        return MathObservation(prompt=f"{problem.problem} {INSTRUCTION}", problem_id=problem.id)

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs: Any) -> MathObservation:
        problem = self._problem
        if problem is None or self._state.outcome is not None:
            raise RuntimeError("MathEnv.step called before reset() or after the problem was answered")
        parsed = parse_reply(action.text)
        outcome: Outcome
        if not parsed:
            outcome, reward = "format_error", self.format_penalty
        else:
            outcome = "correct" if is_correct(problem.answer, parsed) else "wrong"
            reward = float(outcome == "correct")
        self._counters["format_errors" if outcome == "format_error" else outcome] += 1
        self._state.step_count += 1
        self._state.outcome = outcome
        verdict = {"correct": "Correct", "wrong": "Wrong", "format_error": "No answer found"}[outcome]
        return MathObservation(
            prompt=f"{verdict}. The answer is ${problem.answer}$.",
            problem_id=problem.id,
            outcome=outcome,
            answer=problem.answer,
            done=True,
            reward=reward,
            metadata={"correct": int(outcome == "correct"), "format_error": int(outcome == "format_error")},
        )

    @property
    def state(self) -> MathState:
        return self._state.model_copy()

    @property
    def counters(self) -> dict[str, int]:
        return dict(self._counters)

    def warmup_reply(self, obs: MathObservation, rng: random.Random) -> str:
        """A boxed answer of a *different* problem of the split, chosen at random: the answer format and
        LaTeX of this set, with nothing about this problem (its own answer only where another shares it)."""
        others = [p for p in self.problems if p.id != obs.problem_id] or self.problems
        return f"\\boxed{{{rng.choice(others).answer}}}"
