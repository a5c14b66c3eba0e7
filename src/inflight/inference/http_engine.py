"""`HttpEngine`: the Engine protocol (`engine.py`) over `inflight serve-engine` replicas, for synchronous
callers (anything written against the protocol, the contract suite). Owns only the event loop thread that
the async `client.BalancedClient` runs on; balancing, retries and replica recovery are the client's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from inflight.inference.client import (
    BalancedClient,
    BalancedClientMetrics,
    ClientConfig,
    NoReplicaAvailableError,
    weights_bytes,
)
from inflight.types import AdapterUpdate, Completion, SampleRequest, WeightUpdate

T = TypeVar("T")


class HttpEngine:
    """The Engine protocol over HTTP replicas, for synchronous callers (anything written against
    `engine.py`, the contract suite): a BalancedClient on an event loop in a thread of its own.

    Weights and adapters travel as request bodies (no shared filesystem) to every replica and are kept
    here for replicas that recover. One difference from an in-process engine: the requests of one
    `generate` call go out at once, so a request refused by the server (say, an unknown adapter) raises
    after the others have started; they are then cancelled, and the server aborts them.
    """

    def __init__(self, urls: Sequence[str], config: ClientConfig | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="http-engine", daemon=True)
        self._thread.start()
        self._client = BalancedClient(urls, config)
        self._run(self._client.start())
        self._submitted: dict[str, concurrent.futures.Future[Completion]] = {}  # by submit(), in flight
        self._submitted_lock = threading.Lock()

    def __enter__(self) -> HttpEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def version(self) -> int:
        """The oldest base-weights version among the live replicas (from a fresh health check)."""
        live = [v for v in self._run(self._client.versions()).values() if v is not None]
        if not live:
            raise NoReplicaAvailableError(f"version: no replica is up; {self._client._describe()}")
        return min(live)

    def generate(self, requests: Sequence[SampleRequest]) -> list[Completion]:
        return self._run(self._generate(requests))

    # -- as an engine loop (what the service's sampler drives: `api/sampler.py`'s SamplingLoop) ------
    def start(self) -> HttpEngine:
        return self

    def stop(self) -> None:
        self.close()

    def submit(self, request: SampleRequest) -> concurrent.futures.Future[Completion]:
        """Send one request from any thread; its future settles on this engine's event loop thread (a
        request the server refuses: EngineRequestError, a ValueError). `abort(request.request_id)` cancels
        it, and the server aborts it once no caller waits for its batch."""
        future = asyncio.run_coroutine_threadsafe(self._client.generate(request), self._loop)
        with self._submitted_lock:
            self._submitted[request.request_id] = future
        future.add_done_callback(lambda _: self._forget(request.request_id))
        return future

    def abort(self, request_id: str) -> None:
        """Cancel a request `submit` sent (ignored when it finished already)."""
        with self._submitted_lock:
            future = self._submitted.get(request_id)
        if future is not None:
            future.cancel()

    def _forget(self, request_id: str) -> None:
        with self._submitted_lock:
            self._submitted.pop(request_id, None)

    def update_weights(self, update: WeightUpdate) -> None:
        self._run(self._client.update_weights_raw(weights_bytes(update.state_dict), update.version))

    def set_adapter(self, update: AdapterUpdate) -> None:
        self._run(self._client.set_adapter_raw(update))

    def remove_adapter(self, name: str) -> None:
        self._run(self._client.remove_adapter(name))

    def metrics(self) -> BalancedClientMetrics:
        return self._client.metrics()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _generate(self, requests: Sequence[SampleRequest]) -> list[Completion]:
        tasks = [asyncio.ensure_future(self._client.generate(r)) for r in requests]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:  # after a failure: the rest would be answered to nobody
                task.cancel()

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()
