"""VerifierPool: sandboxed executions on a bounded number of workers, awaited or run as a batch.

Owns concurrency, the bound on every wait, and counters; each job is one `run_python` call (a fresh
sandbox). Slow or hostile code costs at most its own wall limit on one worker, and a caller never waits
past `queue_timeout_s + job_timeout_s + KILL_GRACE_S`: `await pool.run(...)` never blocks the event loop.
Each job's memory is bounded as a whole (memory_bound.py): together they hold about concurrency x memory_mb.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from inflight.envs.sandbox.limits import Isolation, IsolationChoice, SandboxLimits
from inflight.envs.sandbox.result import Reason, SandboxResult
from inflight.envs.sandbox.runner import resolve_isolation, run_python

log = logging.getLogger(__name__)

COUNTERS = (
    "submitted", "completed", "ok", "failed", "errors", "timeouts", "queue_timeouts", "wait_timeouts",
    "max_in_flight",
)  # fmt: skip
KILL_GRACE_S = 10.0  # beyond a job's wall limit: killing the process tree and cleaning up


class Verifier(Protocol):
    """What environments need of whoever runs their sandboxed code: `VerifierPool` in this process, or
    `launch/ray/verifiers.py`'s `RayVerifiers` over pools in actors of their own
    (`ray.num_verifier_actors`)."""

    async def run(
        self, code: str, *, stdin: str = "", limits: SandboxLimits | None = None
    ) -> SandboxResult: ...

    def run_many(
        self, codes: Sequence[str], *, stdin: str = "", limits: SandboxLimits | None = None
    ) -> list[SandboxResult]: ...

    def stats(self) -> dict[str, int]: ...


class VerifierPoolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    concurrency: int = Field(default=8, ge=1, le=256)  # sandboxes running at once
    job_timeout_s: float = Field(default=30.0, gt=0, le=3600)  # caps every job's limits.wall_s
    queue_timeout_s: float = Field(default=120.0, gt=0)  # a job that waited longer for a worker is not run
    isolation: IsolationChoice = "auto"
    limits: SandboxLimits = SandboxLimits()  # for jobs that bring none


class VerifierPool:
    """Thread workers, each running one sandboxed process at a time. Thread-safe; share one per process.

    pool = VerifierPool(concurrency=8)
    result = await pool.run("print(1)")         # from asyncio code
    results = pool.run_many(["print(1)", ...])  # from synchronous code, in input order
    """

    def __init__(self, config: VerifierPoolConfig | None = None, **overrides: Any) -> None:
        self.config = config or VerifierPoolConfig(**overrides)
        if config is not None and overrides:
            self.config = config.model_copy(update=overrides)
        self.isolation: Isolation = resolve_isolation(self.config.isolation)  # fails early if unusable
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.config.concurrency, thread_name_prefix="verifier"
        )
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._in_flight = 0

    async def run(self, code: str, *, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
        """The result of one sandboxed execution; a job that cannot finish in time comes back as a
        "timeout" result rather than an exception."""
        limits = self._limits(limits)
        future = self._submit(code, stdin, limits)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self._wait_bound_s(limits))
        except TimeoutError:
            return self._gave_up(future, limits)

    def run_many(
        self, codes: Sequence[str], *, stdin: str = "", limits: SandboxLimits | None = None
    ) -> list[SandboxResult]:
        """Results of sandboxed executions of `codes`, in order, running `concurrency` at a time."""
        limits = self._limits(limits)
        futures = [self._submit(code, stdin, limits) for code in codes]
        # A job starts within queue_timeout_s of submission or is dropped, so one bound covers all.
        deadline = time.monotonic() + self._wait_bound_s(limits)
        results = []
        for future in futures:
            try:
                results.append(future.result(timeout=max(deadline - time.monotonic(), 0.0)))
            except concurrent.futures.TimeoutError:
                results.append(self._gave_up(future, limits))
        return results

    def stats(self) -> dict[str, int]:
        """Counters since start: submitted, completed, ok, failed, errors (the sandbox itself failed),
        timeouts (a job hit its wall limit), queue_timeouts, wait_timeouts, reason_<reason>, in_flight and
        max_in_flight (the most jobs that ran at once)."""
        with self._lock:
            return {**self._counters, "in_flight": self._in_flight}

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _limits(self, limits: SandboxLimits | None) -> SandboxLimits:
        limits = limits or self.config.limits
        if limits.wall_s > self.config.job_timeout_s:
            limits = limits.model_copy(update={"wall_s": self.config.job_timeout_s})
        return limits

    def _wait_bound_s(self, limits: SandboxLimits) -> float:
        return self.config.queue_timeout_s + limits.wall_s + KILL_GRACE_S

    def _submit(
        self, code: str, stdin: str, limits: SandboxLimits
    ) -> concurrent.futures.Future[SandboxResult]:
        self._count("submitted")
        return self._executor.submit(self._job, code, stdin, limits, time.monotonic())

    def _job(self, code: str, stdin: str, limits: SandboxLimits, submitted: float) -> SandboxResult:
        waited_s = time.monotonic() - submitted
        if waited_s > self.config.queue_timeout_s:
            self._count("queue_timeouts")
            message = f"verifier pool: waited {waited_s:.1f} s for a free worker, over queue_timeout_s"
            return self._failed("timeout", message)
        with self._lock:
            self._in_flight += 1
            self._counters["max_in_flight"] = max(self._counters["max_in_flight"], self._in_flight)
        try:
            result = run_python(code, stdin=stdin, limits=limits, isolation=self.isolation)
        except Exception as e:  # fault-tolerance boundary: a broken run is a counted result, never a crash
            log.exception("sandbox run failed")
            result = self._failed(
                "sandbox_error", f"verifier pool: the sandbox failed: {type(e).__name__}: {e}"
            )
        finally:
            with self._lock:
                self._in_flight -= 1
        with self._lock:
            self._counters["completed"] += 1
            self._counters["ok" if result.ok else "failed"] += 1
            if result.reason is not None:
                self._counters[f"reason_{result.reason}"] += 1
            self._counters["errors"] += result.reason == "sandbox_error"
            self._counters["timeouts"] += result.reason == "timeout"
        return result

    def _gave_up(
        self, future: concurrent.futures.Future[SandboxResult], limits: SandboxLimits
    ) -> SandboxResult:
        future.cancel()  # drops the job if it has not started; a running one ends at its wall limit
        self._count("wait_timeouts")
        bound = self._wait_bound_s(limits)
        return self._failed("timeout", f"verifier pool: no result within {bound:.1f} s (queued or running)")

    def _failed(self, reason: Reason, message: str) -> SandboxResult:
        return SandboxResult.not_run(reason, message, self.isolation)

    def _count(self, name: str) -> None:
        with self._lock:
            self._counters[name] += 1


_default: Verifier | None = None
_default_lock = threading.Lock()


def default_pool() -> Verifier:
    """The process-wide verifier environments share unless given their own: the one `set_default_pool`
    installed, else a pool of one worker per core, up to 8, made on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = VerifierPool(concurrency=min(8, os.cpu_count() or 1))
        return _default


def set_default_pool(verifier: Verifier | None) -> Verifier | None:
    """Make `verifier` what `default_pool()` returns from now on (None: a local pool again, on next use);
    returns the one it replaces. A launcher's hook: `launcher=ray` sends the run's sandboxes to actors."""
    global _default
    with _default_lock:
        previous, _default = _default, verifier
        return previous
