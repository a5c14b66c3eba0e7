"""Arithmetic as a single-turn text environment: problems generated from the seed, exact integer answers.

Owns the difficulty levels, the problem generator, answer parsing and the reward; knows nothing of tokens.
One seed fixes one problem, so every rollout of a GRPO group answers the same question.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from inflight.envs.base import Environment, State, TextAction, TextObservation
from inflight.errors import UserError

Op = Literal["+", "-", "*"]
Outcome = Literal["correct", "wrong", "format_error"]
COUNTERS = ("problems", "correct", "wrong", "format_errors")
_ANSWER = re.compile(r"-?[0-9]+")  # the whole reply, after stripping whitespace and one trailing period
MAX_REPLY_CHARS = 64  # longer replies are format errors without parsing: no int() of a huge digit string


class Difficulty(BaseModel):
    """Shape of a level's problems: `num_operands` integers in [0, max_operand] joined by ops drawn from
    `ops`; `*` takes its right operand from [0, max_multiplier] so products stay a few digits long."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_operand: int = Field(ge=1, le=10**6)
    ops: tuple[Op, ...] = Field(min_length=1)
    num_operands: int = Field(default=2, ge=2, le=6)
    max_multiplier: int = Field(default=9, ge=1, le=10**6)

    @model_validator(mode="after")
    def _check(self) -> Difficulty:
        if len(set(self.ops)) != len(self.ops):
            raise ValueError(f"ops has duplicates: {self.ops}")
        return self


# Level 1 is what the tiny model learns by RL within minutes (docs/benchmarks.md); higher levels are
# for larger models.
LEVELS: dict[int, Difficulty] = {
    0: Difficulty(max_operand=4, ops=("+",)),  # 25 problems, one-digit answers 0-8
    1: Difficulty(max_operand=9, ops=("+",)),  # 100 problems: single-digit addition, answers 0-18
    2: Difficulty(max_operand=9, ops=("+", "-")),  # answers -9..18
    3: Difficulty(max_operand=99, ops=("+", "-")),  # two-digit operands
    4: Difficulty(max_operand=99, ops=("+", "-", "*")),  # two-digit mixed ops, products up to 99 * 9
    5: Difficulty(max_operand=999, ops=("+", "-", "*"), num_operands=3, max_multiplier=99),
}


class Problem(BaseModel):
    model_config = ConfigDict(frozen=True)

    text: str  # e.g. "12 + 7 * 3", standard precedence
    answer: int


def make_problem(rng: random.Random, difficulty: Difficulty) -> Problem:
    """A random problem of `difficulty`; its answer is computed with standard operator precedence."""
    ops = [rng.choice(difficulty.ops) for _ in range(difficulty.num_operands - 1)]
    numbers = [rng.randint(0, difficulty.max_operand)]
    for op in ops:
        numbers.append(rng.randint(0, difficulty.max_multiplier if op == "*" else difficulty.max_operand))
    text = " ".join(f"{op} {n}" for op, n in zip(["", *ops], numbers, strict=True)).strip()
    return Problem(text=text, answer=evaluate_expression(numbers, ops))


def evaluate_expression(numbers: Sequence[int], ops: Sequence[str]) -> int:
    """Value of n0 op0 n1 op1 n2 ... with `*` binding tighter than `+`/`-` (no eval of text)."""
    terms, signs = [numbers[0]], [1]
    for op, n in zip(ops, numbers[1:], strict=True):
        if op == "*":
            terms[-1] *= n
        else:
            terms.append(n)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms, strict=True))


def parse_answer(text: str) -> int | None:
    """The integer the reply states, or None: the reply must be the number alone ("17", " -3", "42.")."""
    text = text.strip()
    if len(text) > MAX_REPLY_CHARS:
        return None
    text = text.removesuffix(".")
    return int(text) if _ANSWER.fullmatch(text) else None


def shaped_reward(guess: int, answer: int, partial_credit: float) -> float:
    """1 for the exact answer; a wrong one earns `partial_credit / (1 + |guess - answer|)`, so among
    wrong answers the nearer ones rank higher (a denser signal), and none comes close to a correct one."""
    return 1.0 if guess == answer else partial_credit / (1 + abs(guess - answer))


class ArithmeticObservation(TextObservation):
    """The question; once done, `prompt` states the verdict and the correct answer."""

    problem: str
    outcome: Outcome | None = None
    answer: int | None = None  # revealed once done


class ArithmeticState(State):
    seed: int | None = None
    problem: str = ""
    answer: int | None = None  # hidden from the policy while the episode is live
    outcome: Outcome | None = None


class ArithmeticEnv(Environment[TextAction, ArithmeticObservation, ArithmeticState]):
    """One problem per episode, one reply: reward 1 for the exact integer, else partial credit by distance
    (0 by default), and `format_penalty` for a reply that is not an integer.

    `level` picks a row of LEVELS; max_operand/ops/num_operands/max_multiplier override its fields.
    """

    blocking = False  # quick pure Python: called on the event loop, no thread hop (`Environment.blocking`)

    def __init__(
        self,
        level: int = 1,
        *,
        max_operand: int | None = None,
        ops: list[str] | str | None = None,
        num_operands: int | None = None,
        max_multiplier: int | None = None,
        partial_credit: float = 0.0,
        format_penalty: float = 0.0,
        seed: int | None = None,
    ) -> None:
        if level not in LEVELS:
            raise UserError(f"unknown arithmetic level {level}; choose one of {sorted(LEVELS)}")
        fields = dict(max_operand=max_operand, num_operands=num_operands, max_multiplier=max_multiplier)
        overrides: dict[str, Any] = {k: v for k, v in fields.items() if v is not None}
        if ops is not None:
            overrides["ops"] = tuple(ops.split() if isinstance(ops, str) else ops)
        try:
            self.difficulty = Difficulty.model_validate(LEVELS[level].model_dump() | overrides)
        except ValueError as e:
            raise UserError(f"invalid arithmetic difficulty {overrides}: {e}") from None
        if not 0.0 <= partial_credit < 1.0:
            raise UserError(
                f"partial_credit must be in [0, 1) so a correct answer earns most; got {partial_credit}"
            )
        self.partial_credit = partial_credit
        self.format_penalty = format_penalty
        self._seeds = random.Random(seed)  # problem seeds when reset() gets none
        self._problem: Problem | None = None
        self._state = ArithmeticState()
        self._counters = dict.fromkeys(COUNTERS, 0)

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> ArithmeticObservation:
        if kwargs:
            raise UserError(f"ArithmeticEnv.reset got unknown arguments {sorted(kwargs)}; use seed")
        if seed is None:
            seed = self._seeds.getrandbits(63)
        self._problem = make_problem(random.Random(seed), self.difficulty)
        self._state = ArithmeticState(
            episode_id=episode_id, seed=seed, problem=self._problem.text, answer=self._problem.answer
        )
        self._counters["problems"] += 1
        return ArithmeticObservation(prompt=f"What is {self._problem.text}?", problem=self._problem.text)

    def step(
        self, action: TextAction, timeout_s: float | None = None, **kwargs: Any
    ) -> ArithmeticObservation:
        problem = self._problem
        if problem is None or self._state.outcome is not None:
            raise RuntimeError("ArithmeticEnv.step called before reset() or after the problem was answered")
        guess = parse_answer(action.text)
        if guess is None:
            outcome: Outcome = "format_error"
            reward, verdict = self.format_penalty, "Invalid answer (reply with the integer alone)"
        else:
            outcome = "correct" if guess == problem.answer else "wrong"
            reward = shaped_reward(guess, problem.answer, self.partial_credit)
            verdict = "Correct" if outcome == "correct" else "Wrong"
        self._counters[
            {"correct": "correct", "wrong": "wrong", "format_error": "format_errors"}[outcome]
        ] += 1
        self._state.step_count += 1
        self._state.outcome = outcome
        return ArithmeticObservation(
            prompt=f"{verdict}: {problem.text} = {problem.answer}.",
            problem=problem.text,
            outcome=outcome,
            answer=problem.answer,
            done=True,
            reward=reward,
            metadata={"correct": int(outcome == "correct"), "format_error": int(outcome == "format_error")},
        )

    @property
    def state(self) -> ArithmeticState:
        return self._state.model_copy()

    @property
    def counters(self) -> dict[str, int]:
        return dict(self._counters)

    def warmup_reply(self, obs: ArithmeticObservation, rng: random.Random) -> str:
        """A warm-up reply in the answer format that carries no information about this problem: the answer
        to a different random problem of the same difficulty (so it matches the answers' distribution).

        It equals this problem's answer only by chance; excluding the solution would instead teach the
        model to avoid it.
        """
        return str(make_problem(rng, self.difficulty).answer)
