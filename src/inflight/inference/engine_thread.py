"""Drive one engine from a dedicated thread so that callers in any thread share its continuous batch.

Callers submit requests and get `concurrent.futures.Future`s (or await them from any asyncio loop);
the thread calls `engine.step()` while anything is in flight and resolves each future as its request
finishes. New requests join the running batch at the next step, and `update_weights` is applied by
the engine at a step boundary, so weights change in flight without draining anything.

The pipeline uses this (its trainer thread publishes weights and evaluates while rollouts run in an
asyncio loop); `engine_loop.EngineLoop` is the HTTP server's variant, bound to the server's event loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from typing import Any

from inflight.types import Completion, SampleRequest, WeightUpdate


class EngineThreadError(RuntimeError):
    pass


class EngineThread:
    def __init__(self, engine: Any, name: str = "engine", idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._idle_wait_s = idle_wait_s  # a wake-up ends the wait early; this only bounds a lost one
        self._futures: dict[str, Future[Completion]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        # Counters for the pipeline's idle fractions.
        self.busy_s = 0.0
        self.idle_s = 0.0
        self.steps = 0

    def start(self) -> EngineThread:
        self._thread.start()
        return self

    @property
    def version(self) -> int:
        return int(self.engine.version)

    def submit(self, request: SampleRequest) -> Future[Completion]:
        """Thread-safe: queue `request`; the future resolves with its Completion (or the thread's error)."""
        if self._error is not None:
            raise EngineThreadError(f"the engine thread stopped after an error: {self._error!r}")
        if self._stop.is_set():
            raise EngineThreadError("the engine thread is stopped; no new requests are accepted")
        future: Future[Completion] = Future()
        with self._lock:
            self._futures[request.request_id] = future
        try:
            self.engine.add_request(request)
        except BaseException:
            with self._lock:
                self._futures.pop(request.request_id, None)
            raise
        self._wake.set()
        return future

    async def generate(self, request: SampleRequest, timeout_s: float = 600.0) -> Completion:
        """Await one completion from an asyncio loop (the loop itself never blocks)."""
        future = self.submit(request)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except TimeoutError:
            self.engine.abort(request.request_id)
            raise TimeoutError(
                f"engine request {request.request_id} ({len(request.prompt_token_ids)} prompt tokens, "
                f"max_tokens={request.params.max_tokens}) did not finish within {timeout_s} s"
            ) from None

    def update_weights(self, update: WeightUpdate) -> None:
        """Applied by the engine between two decode steps; requests in flight continue."""
        self.engine.update_weights(update)
        self._wake.set()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Abort what is in flight, stop the thread, and fail any future still open."""
        with self._lock:
            pending = list(self._futures)
        for request_id in pending:
            self.engine.abort(request_id)
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise EngineThreadError(f"the engine thread did not stop within {timeout_s} s")
        self._fail_all(EngineThreadError("the engine thread was stopped before this request finished"))

    def _run(self) -> None:
        try:
            while True:
                if self.engine.has_unfinished():
                    t0 = time.perf_counter()
                    finished = self.engine.step()
                    self.busy_s += time.perf_counter() - t0
                    self.steps += 1
                    for completion in finished:
                        with self._lock:
                            future = self._futures.pop(completion.request_id, None)
                        if future is not None:
                            future.set_result(completion)
                    continue
                if self._stop.is_set():
                    return
                t0 = time.perf_counter()
                woken = self._wake.wait(self._idle_wait_s)
                self._wake.clear()
                self.idle_s += time.perf_counter() - t0
                if woken:
                    # Idle, but maybe new weights arrived: a step with nothing to decode installs them,
                    # so `version` moves on (admission waits for it) without waiting for a request.
                    self.engine.step()
        except BaseException as e:  # the engine is in an unknown state: fail everyone, accept nothing
            self._error = e
            self._fail_all(EngineThreadError(f"the engine failed: {e!r}"))

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            futures, self._futures = self._futures, {}
        for future in futures.values():
            if not future.done():
                future.set_exception(error)
