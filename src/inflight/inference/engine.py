"""The Engine protocol: what rollout workers, the orchestrator and the API need from any inference engine.

Implementations: `builtin.BuiltinEngine` (PyTorch, in-process); a vLLM engine comes later.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from inflight.types import Completion, SampleRequest, WeightUpdate


@runtime_checkable
class Engine(Protocol):
    @property
    def version(self) -> int:
        """Policy version of the weights producing tokens now (a pending update does not count yet)."""
        ...

    def generate(self, requests: Sequence[SampleRequest]) -> list[Completion]:
        """Run the requests to completion; completions come back in request order."""
        ...

    def update_weights(self, update: WeightUpdate) -> None:
        """Install new weights; safe to call from another thread while the engine generates."""
        ...
