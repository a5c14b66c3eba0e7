"""The engine's step thread: drives one BuiltinEngine so that callers in other threads (HTTP handlers,
the pipeline's rollout workers and trainer) submit requests that join the running batch (continuous
batching) and publish weights in flight.

Owns the step thread and the futures of requests in flight; knows nothing about HTTP. Callers go away
all the time (clients disconnect, rollouts time out, fail over): a future its caller cancelled is
simply dropped, and a failed step is kept as `error` for /health to report.

An asyncio caller (`generate`) waits on a future of its own event loop, and the step thread hands a
step's completions to each loop in one `call_soon_threadsafe`. A thread future bridged by
`asyncio.wrap_future` cost one wake-up of the loop per completion: 129-148 us of CPU a request against
62-67 us this way, on the core where the rollouts' Python and the engine's step share the GIL
(docs/benchmarks.md, "Issue 16, fifth session").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from inflight.types import AdapterUpdate, Completion, SampleRequest, WeightUpdate

log = logging.getLogger(__name__)


class EngineLoopError(RuntimeError):
    """The loop cannot take requests: it was stopped, or its step failed (the message says why)."""


class EngineRequestError(RuntimeError):
    """The engine gave up on this one request (its own prefill failed); the loop goes on serving others."""


class EngineLoop:
    """`submit(request) -> Future[Completion]` and `update_weights(update)` from any thread.

    The engine is stepped only by this loop's thread; add_request/abort/update_weights are the engine's
    thread-safe entry points, so callers never wait for a step to submit.
    """

    def __init__(self, engine: Any, idle_wait_s: float = 0.5) -> None:
        self.engine = engine  # a BuiltinEngine (anything with its step/add_request/abort/update_weights)
        self._idle_wait_s = idle_wait_s  # a wake-up ends the wait early; this only bounds a missed one
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards _futures and _error
        # Per request in flight: a thread future (`submit`) or an asyncio caller's waiter (`generate`).
        self._futures: dict[str, concurrent.futures.Future[Completion] | _AsyncWaiter] = {}
        self._error: str | None = None
        # Seconds the thread spent stepping and waiting for work (the pipeline's idle fractions).
        self.busy_s = 0.0
        self.idle_s = 0.0
        self.steps = 0

    @property
    def version(self) -> int:
        """The weights version the engine is generating with (a pending update is not counted yet)."""
        return int(self.engine.version)

    @property
    def error(self) -> str | None:
        """Why the step thread stopped on its own; None while it runs (or after a plain stop())."""
        return self._error

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> EngineLoop:
        if self._thread is not None:
            raise EngineLoopError("the engine loop was already started")
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        return self

    def request_stop(self) -> None:
        """Refuse new requests and have the thread abort those in flight at its next step (their futures
        get finish_reason "abort"), without waiting: any thread, a signal handler's included."""
        self._stop.set()
        self._wake.set()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Abort the requests in flight (their futures get finish_reason "abort") and end the thread."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("the engine loop thread did not stop within %.0f s", timeout_s)
        self._fail_all(EngineLoopError("the engine loop is stopped"))

    def submit(self, request: SampleRequest) -> concurrent.futures.Future[Completion]:
        """Queue a request; ValueError if the engine rejects it, EngineLoopError once stopped or failed."""
        future: concurrent.futures.Future[Completion] = concurrent.futures.Future()
        self._add(request, future)
        return future

    async def generate(self, request: SampleRequest, timeout_s: float) -> Completion:
        """Await one completion from an asyncio loop (which never blocks). Aborted in the engine on timeout
        and when the caller is cancelled (a rollout's own timeout, a run shutting down): its row stops
        decoding at the next step instead of running on to max_tokens for nobody."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Completion] = loop.create_future()
        self._add(request, _AsyncWaiter(loop, future))
        try:
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            self.abort(request.request_id)
            raise TimeoutError(
                f"engine request {request.request_id} ({len(request.prompt_token_ids)} prompt tokens, "
                f"max_tokens={request.params.max_tokens}) did not finish within {timeout_s} s"
            ) from None
        except asyncio.CancelledError:
            self.abort(request.request_id)
            raise

    def update_weights(self, update: WeightUpdate) -> None:
        """Copy the weights now (caller's thread); the loop installs them between two decode steps."""
        self._check_open()
        self.engine.update_weights(update)
        self._wake.set()

    def set_adapter(self, update: AdapterUpdate) -> None:
        """Register or replace a LoRA adapter (checked and copied now); installed between two decode steps."""
        self._check_open()
        self.engine.set_adapter(update)
        self._wake.set()

    def remove_adapter(self, name: str) -> None:
        """Unregister an adapter (the engine's ValueError when there is none); requests on it finish on it."""
        self.engine.remove_adapter(name)

    def abort(self, request_id: str) -> None:
        """Finish a request at the next step with reason "abort" (ignored when it is no longer in flight)."""
        self.engine.abort(request_id)
        self._wake.set()

    def metrics(self) -> dict[str, float]:
        """The engine's in-flight update counters since it started (the pipeline logs them every step)."""
        m = self.engine.metrics()
        applied = max(m.updates_applied, 1)
        return {
            "engine/updates_received": float(m.updates_received),
            "engine/updates_applied": float(m.updates_applied),
            "engine/updates_superseded": float(m.updates_superseded),
            "engine/update_pause_s_mean": m.update_pause_s_total / applied,
            "engine/update_pause_s_max": m.update_pause_s_max,
            "engine/update_copy_s_mean": m.update_copy_s_total / max(m.updates_received, 1),
            "engine/stale_kv_token_frac": m.stale_kv_token_frac,
            "engine/tokens_per_busy_s": m.tokens_per_s,
        }

    def _add(
        self, request: SampleRequest, waiter: concurrent.futures.Future[Completion] | _AsyncWaiter
    ) -> None:
        self._check_open()
        with self._lock:
            if request.request_id in self._futures:
                # Checked before the waiter is stored: storing it first replaced the waiter of the request in
                # flight, which then never heard of its completion, and the caller's abort stopped it.
                raise ValueError(
                    f"request_id {request.request_id!r} is already in flight: give each request its own id"
                )
            self._futures[request.request_id] = waiter
        try:
            self.engine.add_request(request)
        except Exception:
            with self._lock:
                self._futures.pop(request.request_id, None)
            raise
        self._wake.set()

    def _check_open(self) -> None:
        if self._error is not None:
            raise EngineLoopError(f"the engine loop stopped after a failed step: {self._error}")
        if self._stop.is_set():
            raise EngineLoopError("the engine loop is stopped")

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._wake.clear()  # cleared before the check: work added after it sets the event again
            if not (engine.has_unfinished() or engine.has_pending_update()):
                t0 = time.perf_counter()
                self._wake.wait(self._idle_wait_s)
                self.idle_s += time.perf_counter() - t0
                continue
            t0 = time.perf_counter()
            ok = self._step()
            self.busy_s += time.perf_counter() - t0
            self.steps += 1
            if not ok:
                return
        with self._lock:
            in_flight = list(self._futures)
        for request_id in in_flight:  # stop: aborted requests finish in the next step
            engine.abort(request_id)
        while engine.has_unfinished() and self._step():
            pass

    def _step(self) -> bool:
        try:
            finished = self.engine.step()
        except Exception as exc:  # the engine's state is unknown now: fail every caller, report why
            log.exception("engine step failed")
            with self._lock:
                self._error = f"{type(exc).__name__}: {exc}"
            self._fail_all(EngineLoopError(f"the engine step failed: {self._error}"))
            return False
        with self._lock:
            waiters = [self._futures.pop(c.request_id, None) for c in finished]
        _settle_all(
            (waiter, completion, None if completion.error is None else EngineRequestError(completion.error))
            for waiter, completion in zip(waiters, finished, strict=True)
        )
        return True

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            waiters, self._futures = list(self._futures.values()), {}
        _settle_all((waiter, None, error) for waiter in waiters)


class _AsyncWaiter:
    """An asyncio caller's future and the event loop it must be settled on."""

    __slots__ = ("future", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future[Completion]) -> None:
        self.loop, self.future = loop, future


# (whom to tell, the completion, or the error instead); None: a request submitted to the engine directly
_Outcome = tuple[
    concurrent.futures.Future[Completion] | _AsyncWaiter | None, Completion | None, BaseException | None
]
# An asyncio future to settle on its own loop, with its completion or error.
_Settlement = tuple[asyncio.Future[Completion], Completion | None, BaseException | None]


def _settle_all(outcomes: Iterable[_Outcome]) -> None:
    """Thread futures settled here and now; asyncio callers' futures in one callback per event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Settlement]] = {}
    for waiter, result, error in outcomes:
        if waiter is None:
            continue
        if isinstance(waiter, _AsyncWaiter):
            by_loop.setdefault(waiter.loop, []).append((waiter.future, result, error))
            continue
        # A caller may cancel its future from another thread at any moment: a cancelled future just has
        # no reader left.
        try:
            if error is not None:
                waiter.set_exception(error)
            else:
                waiter.set_result(result)  # type: ignore[arg-type]
        except concurrent.futures.InvalidStateError:
            pass
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the caller's event loop is closed: nobody reads these
            loop.call_soon_threadsafe(_settle_on_loop, items)


def _settle_on_loop(items: list[_Settlement]) -> None:
    """On the futures' own event loop; a future whose caller gave up (cancelled, timed out) is skipped."""
    for future, result, error in items:
        if future.done():
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]
