"""The fault-tolerance boundary around a task's `generate_rollout`.

Every call is bounded by `rollout.timeout_s` and its result checked (`rollout_problem`: a Rollout whose
reward is a finite number and whose metrics are numbers); a failure (an exception, a result that is not
such a Rollout, a timeout) is counted and logged with its phase, its problem index and the exception's
first line, and the run goes on without that rollout. Once more than `rollout.max_failed_frac` of the
rollouts failed, `check()` stops the run with a message naming the most common error, counted with ids
(request ids, addresses) set aside: each message that carries one is otherwise unique. Knows nothing of
engines, buffers or steps; the loops, the warm-up and the evaluation each hold one. A guard in another
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
from dataclasses import dataclass, field, replace
from typing import Any

from inflight.config import RolloutConfig
from inflight.errors import UserError, describe
from inflight.orchestrator.task import GenerateRollout, HookError, Problem
from inflight.rollouts.api import RolloutContext
from inflight.types import Rollout

log = logging.getLogger(__name__)
LOGGED_PER_ERROR = 5  # failures logged per distinct error message; the rest are only counted
# What makes one failure's message differ from the next one's of the same cause: a UUID, a hex id of 16+
# digits (a request id: uuid4().hex) or a memory address. Replaced by `<id>` where errors are counted.
_IDS = re.compile(
    r"\b(?:[0-9a-f]{8}-(?:[0-9a-f]{4}-){3}[0-9a-f]{12}|0x[0-9a-f]{6,}|(?=[a-f]*[0-9])[0-9a-f]{16,})\b",
    re.IGNORECASE,
)


@dataclass
class GuardCounts:
    """Rollouts tried and failed (timeouts among them), and how often each error occurred."""

    attempted: int = 0
    failed: int = 0
    timeouts: int = 0
    errors: dict[str, int] = field(default_factory=dict)


class RolloutGuard:
    """`await guard.run(generate_rollout, ctx, problem)` -> the Rollout, or None when it failed.

    `min_rollouts`: how many rollouts must have been tried before `check()` judges the failed fraction
    (a step's worth in training), so one early failure does not stop a run. `what` names the rollouts in
    `check()`'s message; `phase` (training, warm-up, greedy or sampled evaluation) each failure's log line,
    whose problem index means the k-th of the run in training and the i-th test problem in an evaluation.
    A task's optional function failing in a rollout (`HookError`: a `warmup_reply`) is no failed rollout
    but a bug in the task: it passes through, uncounted, and ends the run.
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
        self.errors: Counter[str] = Counter()
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
        self._count(ctx, error, timed_out)
        return None

    def _count(self, ctx: RolloutContext, error: str, timed_out: bool) -> None:
        key = error_key(error)
        with self._lock:
            self.failed += 1
            self.timeouts += timed_out
            self.errors[key] += 1
            seen = self.errors[key]
        if seen <= LOGGED_PER_ERROR:
            more = (
                " (more failures with this error are counted, not logged)" if seen == LOGGED_PER_ERROR else ""
            )
            log.warning(
                "rollout failed (%s): problem %d, sample %d: %s%s",
                self.phase,
                ctx.problem_index,
                ctx.sample_index,
                error,
                more,
            )

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
            delta = GuardCounts(
                self.attempted - last.attempted,
                self.failed - last.failed,
                self.timeouts - last.timeouts,
                {e: n for e, n in errors.items() if n},
            )
            self._reported = GuardCounts(self.attempted, self.failed, self.timeouts, dict(self.errors))
        return delta

    def absorb(self, counts: GuardCounts) -> None:
        """Add the counts of a guard elsewhere (which logged its failures there)."""
        with self._lock:
            self.attempted += counts.attempted
            self.failed += counts.failed
            self.timeouts += counts.timeouts
            self.errors.update(counts.errors)

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


def error_key(error: str) -> str:
    """`error` with its ids replaced by `<id>`: failures of one cause count as one error."""
    return _IDS.sub("<id>", error)
