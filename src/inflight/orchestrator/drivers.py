"""How rollout code reaches the engine: `driver.run(play)` runs `play(generate)` on an event loop of its own
and returns its result, `generate(request) -> Completion` being the policy.

`InlineDriver` steps a BuiltinEngine on that event loop's own thread whenever the rollouts wait for it (the
sync loop, and evaluations outside the pipeline). The rollouts' Python (environment steps, chat templates)
and the engine's steps then alternate in one thread, as in a lockstep batch, with nothing handed between
threads: on 2 cores, 1,000 BlackJack hands took 3.7 s so, 4.2 s with an engine thread contending for the
GIL, 3.4 s in the old lockstep `run_episodes` (best of 5 each, same process). `SubmitDriver` sends requests
to an engine stepped by another thread (the pipeline's engine loop, or its replicas), from the caller's.
Knows nothing of tasks or training.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from inflight.rollouts.api import GenerateFn
from inflight.types import Completion, SampleRequest

T = TypeVar("T")
Play = Callable[[GenerateFn], Awaitable[T]]


class Driver(Protocol):
    def run(self, play: Play[T]) -> T:
        """Run `play(generate)` to its end (from a thread with no event loop running); returns its result."""
        ...


class InlineDriver:
    """Steps `engine` (a BuiltinEngine nobody else steps) on the event loop of `run`, between the rollouts."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._futures: dict[str, asyncio.Future[Completion]] = {}

    def run(self, play: Play[T]) -> T:
        return asyncio.run(self._drive(play))

    async def _drive(self, play: Play[T]) -> T:
        wake = asyncio.Event()  # a request arrived while the engine had nothing to do

        async def generate(request: SampleRequest) -> Completion:
            future = asyncio.get_running_loop().create_future()
            self._futures[request.request_id] = future
            self.engine.add_request(request)
            wake.set()
            try:
                return await future
            except asyncio.CancelledError:  # its rollout timed out or was cancelled: stop generating it
                self._futures.pop(request.request_id, None)
                self.engine.abort(request.request_id)
                raise

        work = asyncio.ensure_future(play(generate))
        try:
            while not work.done():
                # Ordering: every rollout woken by the last step runs (and asks for its next turn) before
                # this one resumes, so the next step batches all of them.
                await asyncio.sleep(0)
                if self.engine.has_unfinished() or self.engine.has_pending_update():
                    for completion in self.engine.step():
                        future = self._futures.pop(completion.request_id, None)
                        if future is not None and not future.done():
                            future.set_result(completion)
                    continue
                wake.clear()
                waiter = asyncio.ensure_future(wake.wait())
                await asyncio.wait([work, waiter], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
            return work.result()
        finally:
            work.cancel()
            for request_id in self._futures:  # left by a failure: the engine is clean for the next run
                self.engine.abort(request_id)
            self._futures.clear()
            while self.engine.has_unfinished():
                self.engine.step()


class SubmitDriver:
    """Requests to an engine stepped elsewhere, through `submit` (an EngineLoop's or the replicas')."""

    def __init__(self, submit: Callable[[SampleRequest], concurrent.futures.Future[Completion]]) -> None:
        self.submit = submit

    def run(self, play: Play[T]) -> T:
        async def generate(request: SampleRequest) -> Completion:
            return await asyncio.wrap_future(self.submit(request))

        async def main() -> T:
            return await play(generate)

        return asyncio.run(main())
