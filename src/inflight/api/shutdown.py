"""The service's way out: refuse new work, let the futures already accepted finish within a grace period,
then fail what is left with an error that names the shutdown, so the SDK and a restarted server see a
definite outcome for every request and nothing waits forever.

Order, whichever way the shutdown starts (a signal to `inflight serve`, or the app's lifespan ending):
  1. `begin`: routes that queue work answer 503 with Retry-After (the SDK retries: a restarted server on
     the same database takes the retry), `/api/v1/healthz` answers 503; polls and reads go on;
  2. `drain`: wait until no future is pending or running, or the grace period is over;
  3. stop the worker claiming, fail every unfinished future (category server) and wake its long-polls.
Under `inflight serve` (`GracefulServer`) all of this happens while uvicorn still listens, so a client
polling a future gets its result or its failure; uvicorn then closes the connections and ends the lifespan.
Knows nothing of what the futures do; the app wires the store, the worker's stop and the board in.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from inflight.api.futures import Future, FutureStatus, FutureStore, RequestType

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5  # what a refused client is told to wait; the SDK honours Retry-After up to 60 s
# The routes that queue work or open a session for it: refused from the moment the shutdown begins.
QUEUEING_PATHS = frozenset(
    f"/api/v1/{name}"
    for name in (
        "create_session",
        "create_model",
        "create_sampling_session",
        "forward",
        "forward_backward",
        "optim_step",
        "save_weights",
        "save_weights_for_sampler",
        "load_weights",
        "asample",
    )
)
HEALTH_PATH = "/api/v1/healthz"


class ServiceShutdown:
    """One per app: `begin` (any thread, signal handlers included: it only takes a timestamp), then `drain`
    (blocking, idempotent: a second caller waits for the first and returns nothing)."""

    def __init__(self, grace_s: float, poll_s: float = 0.1) -> None:
        self.grace_s = grace_s
        self.poll_s = poll_s
        self._deadline: float | None = None  # monotonic; set once by `begin`, moved earlier by `hurry`
        self._reason = ""
        self._drain_lock = threading.Lock()
        self._drained = False
        self._store: FutureStore | None = None
        self._stop_worker: Callable[[], None] = lambda: None
        self._on_failed: Callable[[str, Future], None] = lambda request_id, failed: None

    def attach(
        self, store: FutureStore, *, stop_worker: Callable[[], None], on_failed: Callable[[str, Future], None]
    ) -> None:
        """What the lifespan built: the futures, the worker's (non-blocking) stop, the long-polls' wake-up."""
        self._store, self._stop_worker, self._on_failed = store, stop_worker, on_failed

    @property
    def draining(self) -> bool:
        return self._deadline is not None

    def begin(self, reason: str) -> None:
        """Refuse new work from now on; the grace period starts (the first reason is the one kept)."""
        if self._deadline is None:
            self._reason = reason
            self._deadline = time.monotonic() + self.grace_s

    def hurry(self) -> None:
        """End the grace period now (a second signal): what is still unfinished fails at once."""
        if self._deadline is not None:
            self._deadline = min(self._deadline, time.monotonic())

    def drain(self, reason: str) -> list[Future]:
        """Begin, wait for the futures in flight until the grace period ends, then fail what is left.

        Returns the futures it failed. Never raises: it is the last fault-tolerance boundary, and a future
        it could not fail is failed by the next start's recovery instead."""
        self.begin(reason)
        with self._drain_lock:
            if self._drained:
                return []
            self._drained = True
            return self._drain()

    def _drain(self) -> list[Future]:
        store = self._store
        if store is None:  # the lifespan never started: nothing was accepted
            return []
        log.warning(
            "shutting down (%s): new work is refused; the requests in flight have up to %g s",
            self._reason,
            self.grace_s,
        )
        try:
            while store.unfinished_count() and time.monotonic() < (self._deadline or 0.0):
                time.sleep(self.poll_s)
        except Exception:
            log.exception("could not read the futures while draining; failing what is left now")
        self._stop_worker()  # before failing: the worker must not claim what is about to fail
        try:
            failed = store.fail_unfinished(self._error)
        except Exception:
            log.exception("could not fail the unfinished futures; the next start fails them instead")
            return []
        for future in failed:
            self._on_failed(future.request_id, future)
        if failed:
            log.warning(
                "shutdown: %d unfinished futures failed after the %g s grace period",
                len(failed),
                self.grace_s,
            )
        return failed

    def _error(self, status: FutureStatus, request_type: RequestType) -> str:
        """What a future left unfinished says: whether it ran, and what the client does next."""
        head = f"the server shut down ({self._reason})"
        sample = request_type is RequestType.SAMPLE
        if status == "pending":
            then = "." if sample else " (reload the model from a checkpoint first)."
            return (
                f"{head} before this request started: it never ran. Resubmit it once the server is back{then}"
            )
        grace = f"{self.grace_s:g} s grace period"
        ran = f"{head} while this request was running, and it did not finish within the {grace}"
        if sample:
            return f"{ran}; it was stopped. Resubmit it once the server is back."
        return (
            f"{ran}; its effects may be partly applied (accumulated gradients, an optimizer step, a "
            "half-written checkpoint). Reload the model from its last checkpoint and resubmit."
        )


class RefuseNewWorkMiddleware:
    """While the shutdown drains: 503 with Retry-After for `QUEUEING_PATHS`, and a failing health check so
    load balancers route elsewhere. Every other route (polls, cancels, reads) is served as usual."""

    def __init__(self, app: ASGIApp, shutdown: ServiceShutdown) -> None:
        self.app = app
        self.shutdown = shutdown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.shutdown.draining:
            path = scope["path"]
            if path == HEALTH_PATH:
                await JSONResponse({"status": "shutting_down"}, status_code=503)(scope, receive, send)
                return
            if path in QUEUEING_PATHS:
                detail = (
                    "the server is shutting down and accepts no new work; retry in a few seconds (a "
                    "restarted server takes the retry)"
                )
                headers = {"Retry-After": str(RETRY_AFTER_S)}
                await JSONResponse({"detail": detail}, status_code=503, headers=headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class GracefulServer(uvicorn.Server):
    """uvicorn whose first SIGTERM/SIGINT drains the service while it still listens, then stops as uvicorn
    does (the signal is re-raised at the end, so the exit status says which). A second signal ends the grace
    period at once; after that, uvicorn's own rules apply (another Ctrl-C forces the exit)."""

    def __init__(self, config: uvicorn.Config, shutdown: ServiceShutdown) -> None:
        super().__init__(config)
        self._shutdown = shutdown
        self._drainer: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: only flags and a thread start here, the waiting happens in the thread.
        if self._drainer is None and self.started:
            reason = signal.Signals(sig).name
            self._shutdown.begin(reason)
            self._drainer = threading.Thread(
                target=self._drain, args=(sig, reason), name="inflight-shutdown", daemon=True
            )
            self._drainer.start()
        elif self._drainer is not None and not self.should_exit:
            self._shutdown.hurry()
        else:  # before startup completed, or after the drain: uvicorn's behaviour
            super().handle_exit(sig, frame)

    def _drain(self, sig: int, reason: str) -> None:
        self._shutdown.drain(reason)
        super().handle_exit(sig, None)  # uvicorn now closes the connections and ends the lifespan
