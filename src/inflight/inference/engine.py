"""The Engine protocol: what rollout workers, the orchestrator and the service need from any inference engine.

Implementations: `builtin.BuiltinEngine` (PyTorch, in-process, any device); a vLLM engine comes later. The
meaning of every field (logprob kinds, prompt logprobs, versions, adapters, in-flight updates) is defined
once in docs/architecture.md ("Contracts") and held by `tests/test_engine_contract.py`, which every backend
must pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from inflight.types import AdapterUpdate, Completion, SampleRequest, WeightUpdate


@runtime_checkable
class Engine(Protocol):
    @property
    def version(self) -> int:
        """Policy version of the base weights producing tokens now (a pending update does not count yet)."""
        ...

    def generate(self, requests: Sequence[SampleRequest]) -> list[Completion]:
        """Run the requests to completion; completions come back in request order. A request naming an
        adapter that is not registered raises ValueError naming it, before any request runs."""
        ...

    def update_weights(self, update: WeightUpdate) -> None:
        """Install new base weights between two decode steps; safe to call from another thread while the
        engine generates. Latest call wins."""
        ...

    def set_adapter(self, update: AdapterUpdate) -> None:
        """Register the LoRA adapter `update.name`, or replace its weights; thread-safe. Checked in the
        caller's thread: a module the model lacks or a wrong shape raises ValueError naming the module.
        A replacement is installed between two decode steps; requests in flight on the adapter continue
        on the new weights from that step, their tokens stamped with `update.version`."""
        ...

    def remove_adapter(self, name: str) -> None:
        """Unregister an adapter; thread-safe. Later requests naming it raise ValueError; requests already
        accepted with it finish on the weights it had. ValueError if no adapter has that name."""
        ...


@runtime_checkable
class SteppedEngine(Engine, Protocol):
    """An Engine driven one step at a time by the caller (the engine loop, the pipeline's drivers): requests
    join and leave between steps, which is where updates and adapter swaps land."""

    def add_request(self, request: SampleRequest) -> None:
        """Queue a request (ValueError for bad input, an unknown adapter, a request id in flight)."""
        ...

    def step(self) -> list[Completion]:
        """One decode step for every running request (admitting waiting ones); returns those finished."""
        ...

    def abort(self, request_id: str) -> None:
        """Finish the request at the next step with reason "abort" (ignored if no longer in flight)."""
        ...

    def has_unfinished(self) -> bool: ...
