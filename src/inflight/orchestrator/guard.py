"""The fault-tolerance boundary around a task's `generate_rollout`.

Every call is bounded by `rollout.timeout_s` and its result checked (`rollout_problem`: a Rollout whose
reward is a finite number and whose metrics are numbers); a failure (an exception, a result that is not
such a Rollout, a timeout) is counted and logged with its phase, its problem index and the exception's
first line, and the run goes on without that rollout. Once more than `rollout.max_failed_frac` of the
rollouts failed, `check()` stops the run with a message naming the most common error. Errors are counted
by cause (`error_key`): ids, numbers and quoted text set aside, since a message that quotes a request id or
the policy's reply is otherwise unique; the message quoted is the first of its cause, cut to
`SHOWN_ERROR_CHARS`. Knows nothing of engines, buffers or steps; the loops, both warm-ups and the
evaluation each hold one (the Env warm-up's episodes are synchronous: `run_inline`). A guard in another
process (a rollout worker's) reports its counts (`take_counts`) to the run's guard (`absorb`), which judges
them with its own. The rollout's context carries its deadline (`RolloutContext.deadline`): what it waits
for can be bounded by it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import numbers
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from inflight.config import RolloutConfig
from inflight.errors import UserError, describe
from inflight.orchestrator.task import GenerateRollout, HookError, Problem
from inflight.rollouts.api import RolloutContext
from inflight.types import Rollout

log = logging.getLogger(__name__)
LOGGED_PER_ERROR = 5  # failures logged per cause of error (`error_key`); the rest are only counted
# An error's message in a log line and in check()'s: a task may quote a whole reply or a pydantic error list.
SHOWN_ERROR_CHARS = 200
# The start of an error's message, ids, numbers and quoted text set aside, that makes its cause (`error_key`):
# past it, messages of one cause differ in what the task appended (a reply it could not parse, unquoted).
KEY_CHARS = 100
# What makes one failure's message differ from the next one's of the same cause: a UUID, a hex id of 16+
# digits (a request id: uuid4().hex) or a memory address. Replaced by `<id>` in the message quoted too.
_IDS = re.compile(
    r"\b(?:[0-9a-f]{8}-(?:[0-9a-f]{4}-){3}[0-9a-f]{12}|0x[0-9a-f]{6,}|(?=[a-f]*[0-9])[0-9a-f]{16,})\b",
    re.IGNORECASE,
)
# Quoted text ('...' or "...", as repr() writes a str; an apostrophe inside a word opens or closes none) and
# numbers (a count, a reward, a token id): the data of a message (the reply it quotes), not its cause.
_QUOTED = re.compile(r"""(?<!\w)(['"]).*?\1(?!\w)""")
_NUMBERS = re.compile(r"\b\d+(?:\.\d+)?\b")
_ONE_STR = re.compile(r"'[^']*'|\"[^\"]*\"")  # a message that is one quoted str (a KeyError's key)


@dataclass
class GuardCounts:
    """Rollouts tried and failed (timeouts among them), and how often each error occurred: by cause, under
    the first message of it (`error_example`), with that cause (`error_key`, which a message cut to
    SHOWN_ERROR_CHARS may no longer tell)."""

    attempted: int = 0
    failed: int = 0
    timeouts: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    causes: dict[str, str] = field(default_factory=dict)  # a message of `errors` -> its cause


class RolloutGuard:
    """`await guard.run(generate_rollout, ctx, problem)` -> the Rollout, or None when it failed.

    `min_rollouts`: how many rollouts must have been tried before `check()` judges the failed fraction
    (a step's worth in training), so one early failure does not stop a run. `what` names the rollouts in
    `check()`'s message; `phase` (training, warm-up, greedy or sampled evaluation) each failure's log line,
    whose problem index means the k-th of the run in training, the i-th test problem in an evaluation and
    the train problem played in a warm-up (an Env task's: the episode's seed). A task's optional function
    failing in a rollout (`HookError`: a `warmup_reply`) is no failed rollout but a bug in the task: it
    passes through, uncounted, and ends the run.
    """

    def __init__(
        self, config: RolloutConfig, min_rollouts: int, what: str = "rollouts", phase: str = "training"
    ) -> None:
        self.config = config
        self.min_rollouts = max(1, min_rollouts)
        self.what = what
        self.phase = phase
        self.attempted = 0
        self.failed = 0
        self.timeouts = 0
        self.errors: Counter[str] = Counter()  # by cause, under its first message (`error_example`)
        self._firsts: dict[str, str] = {}  # a cause (`error_key`) -> its first message, its key in `errors`
        self._reported = GuardCounts()  # what take_counts() handed out so far
        # Rollouts run on an asyncio loop while another thread (the pipeline's trainer) reads the counts.
        self._lock = threading.Lock()

    async def run(
        self, generate_rollout: GenerateRollout, ctx: RolloutContext, problem: Problem
    ) -> Rollout | None:
        """The task's rollout; a cancellation (the run shutting down) passes through, never counted."""
        with self._lock:
            self.attempted += 1
        timed_out = False
        ctx = replace(ctx, deadline=time.monotonic() + self.config.timeout_s)
        try:
            async with asyncio.timeout(self.config.timeout_s) as deadline:
                result = await generate_rollout(ctx, problem)
        except TimeoutError as e:
            timed_out = deadline.expired()  # else the task's own TimeoutError
            limit = f"rollout.timeout_s={self.config.timeout_s:g}"
            error = f"TimeoutError: generate_rollout ran past {limit} s" if timed_out else describe(e)
        except HookError:
            raise
        except Exception as e:  # the task's own failure: counted, and fatal only in numbers (`check`)
            error = describe(e)
        else:
            wrong = rollout_problem(result)
            if wrong is None:
                return result
            error = wrong
        self._count(ctx.problem_index, ctx.sample_index, error, timed_out)
        return None

    def run_inline(
        self, play: Callable[[], Rollout], problem_index: int, sample_index: int = 0
    ) -> Rollout | None:
        """`play()`'s Rollout, or None when it failed: a rollout played synchronously, in this thread (the Env
        warm-up's scripted episodes, which take turns on one environment), judged as `run` judges one. No
        timeout: nothing ends a synchronous call from outside."""
        with self._lock:
            self.attempted += 1
        try:
            result = play()
        except HookError:
            raise
        except Exception as e:  # the environment's own failure (a server that is down, a bug in `step`)
            error = describe(e)
        else:
            wrong = rollout_problem(result)
            if wrong is None:
                return result
            error = wrong
        self._count(problem_index, sample_index, error, timed_out=False)
        return None

    def _count(self, problem_index: int, sample_index: int, error: str, timed_out: bool) -> None:
        with self._lock:
            self.failed += 1
            self.timeouts += timed_out
            seen = self._add(error_key(error), error_example(error), 1)
        if seen <= LOGGED_PER_ERROR:
            more = (
                " (more failures with this error are counted, not logged)" if seen == LOGGED_PER_ERROR else ""
            )
            log.warning(
                "rollout failed (%s): problem %d, sample %d: %s%s",
                self.phase,
                problem_index,
                sample_index,
                _clipped(error),
                more,
            )

    def _add(self, cause: str, example: str, count: int) -> int:
        """Count `count` failures of `cause` (`example` one of its messages), under the first message seen of
        it; returns how many that cause has now. Called under the lock."""
        first = self._firsts.setdefault(cause, example)
        self.errors[first] += count
        return self.errors[first]

    def check(self) -> None:
        """Raise UserError once more than `max_failed_frac` of at least `min_rollouts` rollouts failed."""
        with self._lock:
            attempted, failed = self.attempted, self.failed
            common = self.errors.most_common(1)
        if attempted < self.min_rollouts or failed <= self.config.max_failed_frac * attempted:
            return
        error, count = common[0]
        raise UserError(
            f"stopped: {failed} of {attempted} {self.what} failed, more than rollout.max_failed_frac="
            f"{self.config.max_failed_frac:g}; the most common error ({count}x): {error}"
        )

    def take_counts(self) -> GuardCounts:
        """The counts since the last call (for a guard in another process to `absorb`)."""
        with self._lock:
            last = self._reported
            errors = {e: n - last.errors.get(e, 0) for e, n in self.errors.items()}
            new = {e: n for e, n in errors.items() if n}
            causes = {first: cause for cause, first in self._firsts.items() if first in new}
            delta = GuardCounts(
                self.attempted - last.attempted,
                self.failed - last.failed,
                self.timeouts - last.timeouts,
                new,
                causes,
            )
            self._reported = GuardCounts(self.attempted, self.failed, self.timeouts, dict(self.errors))
        return delta

    def absorb(self, counts: GuardCounts) -> None:
        """Add the counts of a guard elsewhere (which logged its failures there)."""
        with self._lock:
            self.attempted += counts.attempted
            self.failed += counts.failed
            self.timeouts += counts.timeouts
            for example, count in counts.errors.items():  # under this guard's first message of each cause
                self._add(counts.causes.get(example) or error_key(example), example, count)

    def metrics(self) -> dict[str, float]:
        """Failures so far (timeouts included) and timeouts alone."""
        with self._lock:
            return {"rollout_errors": float(self.failed), "rollout_timeouts": float(self.timeouts)}


def rollout_problem(result: Any) -> str | None:
    """What is wrong with `generate_rollout`'s result, as an error message; None for a usable Rollout.

    A reward trains the policy: NaN or inf would poison every advantage of its group (and the step's
    statistics), so it fails the rollout like an exception would. Metrics are only averaged and logged, but
    one that is not a number cannot be averaged: named, with its type. The reward and metrics of a usable
    Rollout are made plain floats (a numpy float or an int from a task averages and serialises as one).
    """
    if not isinstance(result, Rollout):
        return f"TypeError: generate_rollout returned a {type(result).__name__}, not a Rollout"
    reward = _as_float(result.reward)
    if reward is None:
        return f"TypeError: reward is a {type(result.reward).__name__} ({result.reward!r:.40}), not a number"
    if not math.isfinite(reward):
        return f"ValueError: reward is {reward}: a rollout's reward must be a finite number"
    if not isinstance(result.metrics, dict):
        return f"TypeError: metrics is a {type(result.metrics).__name__}, not a dict of numbers"
    metrics = {}
    for key, value in result.metrics.items():
        if not isinstance(key, str):
            return f"TypeError: metrics key {key!r:.40} ({type(key).__name__}) is not a str"
        number = _as_float(value)
        if number is None:
            return (
                f"TypeError: metrics[{key!r}] is a {type(value).__name__} ({value!r:.40}), not a number: "
                "metrics are averaged; keep other information out of them"
            )
        metrics[key] = number
    result.reward, result.metrics = reward, metrics
    return None


def _as_float(value: Any) -> float | None:
    """`value` as a float when it is a real number (bool, int, float, numpy scalar); else None."""
    if not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:  # an int past float's range
        return math.inf


def error_example(error: str) -> str:
    """`error` as `check()` quotes it: its ids replaced by `<id>`, cut to SHOWN_ERROR_CHARS."""
    return _clipped(_IDS.sub("<id>", error))


def error_key(error: str) -> str:
    """The cause of `error`, what failures are counted by: its type and the start of its message, with ids,
    numbers and quoted text set aside (`ValueError: no answer in '…' after <n> turns`). A message that is
    nothing but a quoted str is kept whole: a KeyError's, whose key is its cause (`KeyError: 'answer'`)."""
    error = _IDS.sub("<id>", error)
    _, _, message = error.partition(": ")
    if not _ONE_STR.fullmatch(message):
        error = _NUMBERS.sub("<n>", _QUOTED.sub("'…'", error))
    return error[:KEY_CHARS]


def _clipped(text: str) -> str:
    """`text`, or its start and an ellipsis past SHOWN_ERROR_CHARS (the same text when clipped again)."""
    return text if len(text) <= SHOWN_ERROR_CHARS else text[: SHOWN_ERROR_CHARS - 1] + "…"
