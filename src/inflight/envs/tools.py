"""Tools as a multi-turn text environment: the model may run Python (in the sandbox) before it answers.

Owns the task generator (small computations whose answers are checked exactly: big-number arithmetic,
primes, string manipulation), the reply protocol and the reward; knows nothing of tokens. A reply is
either a tool call, `<python>CODE</python>`, whose stdout and stderr come back as the next observation
(so rollouts mask the tool output out of the loss, like every environment turn), or the final answer,
`<answer>TEXT</answer>`. One seed fixes one task, so every rollout of a GRPO group faces the same task.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from inflight.envs.base import Environment, State, TextAction, TextObservation
from inflight.envs.code import extract_code
from inflight.envs.sandbox import (
    SandboxLimits,
    SandboxResult,
    Verifier,
    default_pool,
    merge_limits,
    within_time,
)
from inflight.errors import UserError

# Per execution (one unit test, one tool call): small programs that finish in well under a second.
DEFAULT_LIMITS = SandboxLimits(wall_s=5.0, cpu_s=5, memory_mb=512, max_output_bytes=65536)
Outcome = Literal["correct", "wrong", "format_error", "tool_limit"]
COUNTERS = ("episodes", "correct", "wrong", "format_errors", "tool_limits", "tool_calls", "tool_errors")
_TAG = re.compile(r"<(python|answer)>(.*?)</\1>", re.DOTALL)  # the first complete tag decides the turn
MAX_TOOL_OUTPUT_CHARS = 1000  # per observation; head and tail are kept (a traceback ends in its cause)
_WORDS = (
    "apple", "banana", "cherry", "delta", "echo", "falcon", "garden", "harbor", "island", "jungle", "kettle",
    "lemon", "meadow", "nectar", "ocean", "pepper", "quartz", "river", "saddle", "timber", "umbrella",
    "violet", "walnut", "yonder", "zephyr", "anchor", "breeze", "candle",
)  # fmt: skip


class ToolTask(BaseModel):
    model_config = ConfigDict(frozen=True)

    kind: str
    question: str
    answer: str  # compared with the reply after `normalize_answer`
    numeric: bool  # whether digit-group separators (",", "_", spaces) are ignored when comparing


def _multiply(rng: random.Random) -> ToolTask:
    a, b = rng.randrange(10**14, 10**19), rng.randrange(10**14, 10**19)
    return ToolTask(kind="multiply", question=f"What is {a} * {b}?", answer=str(a * b), numeric=True)


def _power_digit_sum(rng: random.Random) -> ToolTask:
    base, exponent = rng.randint(2, 9), rng.randint(100, 400)
    question = f"What is the sum of the decimal digits of {base}**{exponent}?"
    return ToolTask(
        kind="power_digit_sum",
        question=question,
        answer=str(sum(map(int, str(base**exponent)))),
        numeric=True,
    )


def _modpow(rng: random.Random) -> ToolTask:
    a, e, m = rng.randrange(10**3, 10**6), rng.randrange(10**6, 10**9), rng.randrange(10**5, 10**9)
    return ToolTask(
        kind="modpow", question=f"What is {a}**{e} mod {m}?", answer=str(pow(a, e, m)), numeric=True
    )


def _gcd(rng: random.Random) -> ToolTask:
    g = rng.randrange(10**3, 10**6)
    x, y = rng.randrange(10**8, 10**10), rng.randrange(10**8, 10**10)
    while _gcd_int(x, y) != 1:  # so the answer is exactly g
        y += 1
    question = f"What is the greatest common divisor of {g * x} and {g * y}?"
    return ToolTask(kind="gcd", question=question, answer=str(g), numeric=True)


def _nth_prime(rng: random.Random) -> ToolTask:
    n = rng.randint(200, 3000)
    question = f"What is the {_ordinal(n)} prime number? (The 1st prime is 2.)"
    return ToolTask(
        kind="nth_prime", question=question, answer=str(_primes_up_to(30_000)[n - 1]), numeric=True
    )


def _reverse(rng: random.Random) -> ToolTask:
    text = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(24, 40)))
    return ToolTask(
        kind="reverse", question=f"What is the string '{text}' reversed?", answer=text[::-1], numeric=False
    )


def _count_letter(rng: random.Random) -> ToolTask:
    text = "".join(rng.choices("abcdef", k=rng.randint(120, 200)))
    letter = rng.choice("abcdef")
    question = f"How many times does the letter '{letter}' occur in '{text}'?"
    return ToolTask(kind="count_letter", question=question, answer=str(text.count(letter)), numeric=True)


def _sort_words(rng: random.Random) -> ToolTask:
    words = rng.sample(_WORDS, 8)
    question = f"Sort these words alphabetically and give them separated by single spaces: {' '.join(words)}"
    return ToolTask(kind="sort_words", question=question, answer=" ".join(sorted(words)), numeric=False)


TASK_KINDS: dict[str, Callable[[random.Random], ToolTask]] = {
    "multiply": _multiply,
    "power_digit_sum": _power_digit_sum,
    "modpow": _modpow,
    "gcd": _gcd,
    "nth_prime": _nth_prime,
    "reverse": _reverse,
    "count_letter": _count_letter,
    "sort_words": _sort_words,
}


def make_task(seed: int, kinds: tuple[str, ...] = tuple(TASK_KINDS)) -> ToolTask:
    rng = random.Random(seed)
    return TASK_KINDS[rng.choice(kinds)](rng)


def normalize_answer(text: str, numeric: bool) -> str:
    """Whitespace collapsed, surrounding quotes and a final period dropped; numbers lose separators."""
    text = " ".join(text.split()).strip("'\"`").removesuffix(".").strip()
    return re.sub(r"[,_ ]", "", text) if numeric else text


def parse_reply(text: str) -> tuple[Literal["python", "answer"], str] | None:
    """The turn's action: ("python", code) or ("answer", text), from the first complete tag; else None."""
    match = _TAG.search(text)
    if match is None:
        return None
    kind, body = match.group(1), match.group(2)
    if kind == "python" and "```" in body:
        body = extract_code(body) or ""
    return ("python" if kind == "python" else "answer"), body.strip("\n")


def format_tool_output(result: SandboxResult, max_chars: int = MAX_TOOL_OUTPUT_CHARS) -> str:
    """What the model sees of a tool run: its output (head and tail if long) and how it ended."""
    output = result.output
    if len(output) > max_chars:
        head, tail = output[: max_chars * 3 // 5], output[-(max_chars * 2 // 5) :]
        output = f"{head}\n...[{len(output) - len(head) - len(tail)} characters cut]...\n{tail}"
    status = "exit 0" if result.ok else f"failed: {result.reason}"
    return f"<output>\n{output.rstrip()}\n</output> ({status})"


class ToolsObservation(TextObservation):
    """The task, and after a tool call its output; once done, `prompt` gives the verdict and answer."""

    task: str
    tool_output: str | None = None  # the last tool call's formatted output
    tool_calls_left: int
    legal_actions: list[str]  # "python" while tool calls are left, "answer"; empty once done
    outcome: Outcome | None = None
    answer: str | None = None  # revealed once done


class ToolsState(State):
    seed: int | None = None
    task: ToolTask | None = None  # holds the answer: hidden from the policy while the episode is live
    tool_calls: int = 0
    tool_errors: int = 0
    outcome: Outcome | None = None


class ToolsEnv(Environment[TextAction, ToolsObservation, ToolsState]):
    """A task per episode; up to `max_tool_calls` Python runs, then an answer: reward 1 if it is exactly
    right, else 0. A reply with neither tag, or a tool call past the limit, ends the episode with
    `format_penalty`. `step_async` runs tools without blocking an event loop; a step's `timeout_s` (the
    seconds its episode has left) caps the tool call's wall_s."""

    def __init__(
        self,
        *,
        max_tool_calls: int = 3,
        kinds: list[str] | str | None = None,
        format_penalty: float = 0.0,
        limits: SandboxLimits | dict[str, Any] | None = None,  # a dict comes from a run config
        pool: Verifier | None = None,
        seed: int | None = None,
    ) -> None:
        if max_tool_calls < 0:
            raise UserError(f"max_tool_calls must be >= 0, got {max_tool_calls}")
        names = tuple(kinds.split(",") if isinstance(kinds, str) else kinds or TASK_KINDS)
        if unknown := [k for k in names if k not in TASK_KINDS]:
            raise UserError(f"unknown tool task kinds {unknown}; choose from {', '.join(TASK_KINDS)}")
        self.kinds = names
        self.max_tool_calls = max_tool_calls
        self.format_penalty = format_penalty
        self.limits = merge_limits(DEFAULT_LIMITS, limits)
        self._pool = pool
        self._seeds = random.Random(seed)
        self._state = ToolsState()
        self._counters = dict.fromkeys(COUNTERS, 0)

    @property
    def pool(self) -> Verifier:
        if self._pool is None:
            self._pool = default_pool()
        return self._pool

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> ToolsObservation:
        if kwargs:
            raise UserError(f"ToolsEnv.reset got unknown arguments {sorted(kwargs)}; use seed")
        if seed is None:
            seed = self._seeds.getrandbits(63)
        task = make_task(seed, self.kinds)
        self._state = ToolsState(episode_id=episode_id, seed=seed, task=task)
        self._counters["episodes"] += 1
        prompt = (
            f"{task.question}\nYou can run Python by replying <python>CODE</python>; you will see what "
            "it prints. Give the final result as <answer>RESULT</answer>. "
            f"You have {self.max_tool_calls} tool calls."
        )
        return self._observe(prompt)

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs: Any) -> ToolsObservation:
        parsed = self._parse(action)
        if parsed is not None and parsed[0] == "python" and self._calls_left() > 0:
            limits = within_time(self.limits, timeout_s)
            return self._tool_turn(self.pool.run_many([parsed[1]], limits=limits)[0])
        return self._final_turn(parsed)

    async def step_async(
        self, action: TextAction, timeout_s: float | None = None, **kwargs: Any
    ) -> ToolsObservation:
        parsed = self._parse(action)
        if parsed is not None and parsed[0] == "python" and self._calls_left() > 0:
            limits = within_time(self.limits, timeout_s)
            return self._tool_turn(await self.pool.run(parsed[1], limits=limits))
        return self._final_turn(parsed)

    @property
    def state(self) -> ToolsState:
        return self._state.model_copy()

    @property
    def counters(self) -> dict[str, int]:
        return dict(self._counters)

    def _parse(self, action: TextAction) -> tuple[Literal["python", "answer"], str] | None:
        if self._state.task is None or self._state.outcome is not None:
            raise RuntimeError("ToolsEnv.step called before reset() or after the episode ended")
        self._state.step_count += 1
        return parse_reply(action.text)

    def _calls_left(self) -> int:
        return self.max_tool_calls - self._state.tool_calls

    def _tool_turn(self, result: SandboxResult) -> ToolsObservation:
        self._state.tool_calls += 1
        self._state.tool_errors += not result.ok
        self._counters["tool_calls"] += 1
        self._counters["tool_errors"] += not result.ok
        output = format_tool_output(result)
        left = self._calls_left()
        hint = (
            f"You have {left} tool calls left."
            if left
            else "No tool calls left: reply with <answer>RESULT</answer>."
        )
        return self._observe(f"{output}\n{hint}", tool_output=output)

    def _final_turn(self, parsed: tuple[Literal["python", "answer"], str] | None) -> ToolsObservation:
        task = self._state.task
        assert task is not None
        outcome: Outcome
        if parsed is None:
            outcome, reward, verdict = (
                "format_error",
                self.format_penalty,
                "Invalid reply (no <python> or <answer>)",
            )
        elif parsed[0] == "python":
            outcome, reward, verdict = "tool_limit", self.format_penalty, "Tool call past the limit"
        elif normalize_answer(parsed[1], task.numeric) == normalize_answer(task.answer, task.numeric):
            outcome, reward, verdict = "correct", 1.0, "Correct"
        else:
            outcome, reward, verdict = "wrong", 0.0, "Wrong"
        self._state.outcome = outcome
        counter = {"format_error": "format_errors", "tool_limit": "tool_limits"}.get(outcome, outcome)
        self._counters[counter] += 1
        return self._observe(
            f"{verdict}; the answer is {task.answer}.",
            done=True,
            reward=reward,
            outcome=outcome,
            answer=task.answer,
            metadata={
                "correct": int(outcome == "correct"),
                "format_error": int(outcome in ("format_error", "tool_limit")),
                "tool_calls": self._state.tool_calls,
                "tool_errors": self._state.tool_errors,
            },
        )

    def _observe(self, prompt: str, **fields: Any) -> ToolsObservation:
        task = self._state.task
        assert task is not None
        done = bool(fields.get("done"))
        legal = [] if done else (["python", "answer"] if self._calls_left() > 0 else ["answer"])
        return ToolsObservation(
            prompt=prompt,
            task=task.question,
            tool_calls_left=self._calls_left(),
            legal_actions=legal,
            **fields,
        )


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _gcd_int(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _primes_up_to(n: int) -> list[int]:
    sieve = bytearray([1]) * (n + 1)
    sieve[:2] = b"\x00\x00"
    for k in range(2, int(n**0.5) + 1):
        if sieve[k]:
            sieve[k * k :: k] = bytearray(len(range(k * k, n + 1, k)))
    return [k for k in range(n + 1) if sieve[k]]
