"""Verifier actors: sandbox pools on CPU bundles of their own (`VerifierActor`), reached through the
`Verifier` protocol (`RayVerifiers`), each job to the least busy. Knows sandbox jobs, not the environments
that send them."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from inflight.envs.sandbox.pool import KILL_GRACE_S
from inflight.errors import describe

if TYPE_CHECKING:
    from inflight.envs.sandbox import Isolation, SandboxLimits, SandboxResult, VerifierPoolConfig

VERIFIER_TASK_RETRIES = 2  # how often Ray runs a job again on a verifier actor it restarted
# How long an actor holds back a job SIGKILLed by someone other than its sandbox before answering. A Ray
# worker that is being killed SIGKILLs its child processes first and exits after, so in between the job
# reads as "killed" by an outside signal: held back, the answer dies with the actor and Ray runs the job
# again on the restarted one, instead of scoring the reply's code as failed.
EXTERNAL_KILL_GRACE_S = 2.0


class VerifierActor:
    """A sandbox pool (`envs/sandbox/pool.py`'s VerifierPool, `concurrency` workers) on a CPU bundle of its
    own: the sandboxed code of the run's environments runs here, not beside the trainer. Stateless, so Ray
    restarts it whenever it dies; `RayVerifiers` is its client."""

    def __init__(self, concurrency: int, external_kill_grace_s: float = EXTERNAL_KILL_GRACE_S) -> None:
        from inflight.envs.sandbox import VerifierPool

        self.pool = VerifierPool(concurrency=concurrency)
        self.external_kill_grace_s = external_kill_grace_s

    def run(self, code: str, stdin: str, limits: SandboxLimits | None) -> SandboxResult:
        result = self.pool.run_many([code], stdin=stdin, limits=limits)[0]
        if result.reason == "killed" and result.exit_code == -signal.SIGKILL:
            time.sleep(self.external_kill_grace_s)  # see EXTERNAL_KILL_GRACE_S: we may be dying too
        return result

    def isolation(self) -> Isolation:
        return self.pool.isolation

    def stats(self) -> dict[str, int]:
        return self.pool.stats()


class RayVerifiers:
    """The `Verifier` protocol (`envs/sandbox/pool.py`) over `VerifierActor`s: each job to the actor with
    the fewest in flight. A job is bounded as the pool bounds it (queue, wall limit, kill grace). Ray
    restarts an actor that dies and runs its jobs again there (`VERIFIER_TASK_RETRIES`: a sandbox is
    throwaway, so a job may run twice); one that still finds no actor, or runs out of time, comes back as
    a "sandbox_error" / "timeout" result, counted, never as an exception."""

    def __init__(self, actors: list[Any], config: VerifierPoolConfig | None = None) -> None:
        import ray

        from inflight.envs.sandbox import VerifierPoolConfig

        self._ray, self._actors = ray, actors
        self.config = config or VerifierPoolConfig()
        self._in_flight = [0] * len(actors)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("submitted", "completed", "actor_failures", "wait_timeouts"), 0)
        self._isolation = ray.get(actors[0].isolation.remote(), timeout=self.config.queue_timeout_s)

    async def run(self, code: str, *, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
        import asyncio

        index, ref = self._submit(code, stdin, limits)
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(ref.future()), self._bound_s(limits))
        except BaseException as exc:
            return self._failed(index, ref, exc)
        return self._done(index, result)

    def run_many(
        self, codes: Sequence[str], *, stdin: str = "", limits: SandboxLimits | None = None
    ) -> list[SandboxResult]:
        deadline = time.monotonic() + self._bound_s(limits)
        results = []
        for index, ref in [self._submit(code, stdin, limits) for code in codes]:
            try:
                result = self._ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
            except Exception as exc:
                results.append(self._failed(index, ref, exc))
            else:
                results.append(self._done(index, result))
        return results

    def stats(self) -> dict[str, int]:
        """This client's counters, and the actors' pools' summed (those that answer within 10 s)."""
        refs = [actor.stats.remote() for actor in self._actors]
        ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=10)
        total: dict[str, int] = {}
        for ref in ready:
            with contextlib.suppress(self._ray.exceptions.RayError):
                for key, value in self._ray.get(ref).items():
                    total[key] = total.get(key, 0) + value
        with self._lock:
            return total | {f"client_{key}": value for key, value in self._counts.items()}

    def metrics(self) -> dict[str, float]:
        """For the run's metrics, without asking the actors: jobs sent, finished, and lost."""
        with self._lock:
            return {f"verifiers/{key}": float(value) for key, value in self._counts.items()}

    def _bound_s(self, limits: SandboxLimits | None) -> float:
        wall_s = min((limits or self.config.limits).wall_s, self.config.job_timeout_s)
        return self.config.queue_timeout_s + wall_s + KILL_GRACE_S

    def _submit(self, code: str, stdin: str, limits: SandboxLimits | None) -> tuple[int, Any]:
        with self._lock:
            index = min(range(len(self._actors)), key=self._in_flight.__getitem__)
            self._in_flight[index] += 1
            self._counts["submitted"] += 1
        return index, self._actors[index].run.remote(code, stdin, limits)

    def _done(self, index: int, result: SandboxResult) -> SandboxResult:
        with self._lock:
            self._in_flight[index] -= 1
            self._counts["completed"] += 1
        return result

    def _failed(self, index: int, ref: Any, exc: BaseException) -> SandboxResult:
        from inflight.envs.sandbox import SandboxResult

        timed_out = isinstance(exc, TimeoutError | self._ray.exceptions.GetTimeoutError)
        with self._lock:
            self._in_flight[index] -= 1
            self._counts["wait_timeouts" if timed_out else "actor_failures"] += 1
        if timed_out:
            self._ray.cancel(ref, force=False)
            return SandboxResult.not_run(
                "timeout", "verifier actor: no result within the pool's bound", self._isolation
            )
        if isinstance(exc, Exception):
            return SandboxResult.not_run(
                "sandbox_error", f"verifier actor failed: {describe(exc)}", self._isolation
            )
        raise exc  # a cancellation of the caller, say: not ours to swallow
