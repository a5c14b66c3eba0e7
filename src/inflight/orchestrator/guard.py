"""The fault-tolerance boundary around a task's `generate_rollout`.

Every call is bounded by `rollout.timeout_s` and its result type-checked; a failure (an exception, a
result that is not a Rollout, a timeout) is counted and logged with its problem index and the
exception's first line, and the run goes on without that rollout. Once more than
`rollout.max_failed_frac` of the rollouts failed, `check()` stops the run with a message naming the most
common error. Knows nothing of engines, buffers or steps; the loops and the evaluation each hold one.
A guard in another process (a rollout worker's) reports its counts (`take_counts`) to the run's guard
(`absorb`), which judges them with its own.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field

from inflight.config import RolloutConfig
from inflight.errors import UserError, describe
from inflight.orchestrator.task import GenerateRollout, Problem
from inflight.rollouts.api import RolloutContext
from inflight.types import Rollout

log = logging.getLogger(__name__)
LOGGED_PER_ERROR = 5  # failures logged per distinct error message; the rest are only counted


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
    (a step's worth in training), so one early failure does not stop a run.
    """

    def __init__(self, config: RolloutConfig, min_rollouts: int, what: str = "rollouts") -> None:
        self.config = config
        self.min_rollouts = max(1, min_rollouts)
        self.what = what
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
        try:
            async with asyncio.timeout(self.config.timeout_s) as deadline:
                result = await generate_rollout(ctx, problem)
        except TimeoutError as e:
            timed_out = deadline.expired()  # else the task's own TimeoutError
            limit = f"rollout.timeout_s={self.config.timeout_s:g}"
            error = f"TimeoutError: generate_rollout ran past {limit} s" if timed_out else describe(e)
        except Exception as e:  # the task's own failure: counted, and fatal only in numbers (`check`)
            error = describe(e)
        else:
            if isinstance(result, Rollout):
                return result
            error = f"TypeError: generate_rollout returned a {type(result).__name__}, not a Rollout"
        self._count(ctx, error, timed_out)
        return None

    def _count(self, ctx: RolloutContext, error: str, timed_out: bool) -> None:
        with self._lock:
            self.failed += 1
            self.timeouts += timed_out
            self.errors[error] += 1
            seen = self.errors[error]
        if seen <= LOGGED_PER_ERROR:
            more = (
                " (more failures with this error are counted, not logged)" if seen == LOGGED_PER_ERROR else ""
            )
            log.warning(
                "rollout failed: problem %d, sample %d: %s%s",
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
