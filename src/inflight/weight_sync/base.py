"""The weight-sync interface: `WeightPublisher` on the trainer side, `WeightReceiver` on the inference side.

A publish moves one complete state dict tagged with its policy version; a receiver hands out whole updates
only (never a mix of two versions), newest first. Transports (one file each) know nothing of engines.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import torch

from inflight.types import WeightUpdate


@dataclass(frozen=True)
class PublishStats:
    """What one publish cost; `transfer_s` is the time the trainer was blocked in `publish`."""

    version: int
    num_bytes: int
    num_tensors: int
    transfer_s: float
    num_buckets: int = 1  # messages the payload was split into (torch.distributed: broadcasts)

    def as_metrics(self, prefix: str = "weight_sync/") -> dict[str, float]:
        return {
            f"{prefix}transfer_s": self.transfer_s,
            f"{prefix}bytes": float(self.num_bytes),
            f"{prefix}buckets": float(self.num_buckets),
        }


class WeightPublisher(ABC):
    """Trainer side. `publish` returns when the receivers can get `version` (or, for collectives, have it);
    the caller may change its tensors afterwards."""

    last_stats: PublishStats | None = None

    @abstractmethod
    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> PublishStats: ...

    def close(self) -> None:  # noqa: B027 - optional: most transports hold nothing to release
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class WeightReceiver(ABC):
    """Inference side. `poll` never blocks; both return only updates newer than the last one returned."""

    # How often `wait` re-polls transports that cannot be woken (files); overridden where they can.
    poll_interval_s: float = 0.01

    @abstractmethod
    def poll(self) -> WeightUpdate | None:
        """The newest complete update not yet returned, or None."""

    def wait(self, min_version: int, timeout_s: float) -> WeightUpdate:
        """Block until an update with version >= min_version arrives; TimeoutError names what was awaited."""
        deadline = time.monotonic() + timeout_s
        while True:
            update = self.poll()
            if update is not None and update.version >= min_version:
                return update
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"{type(self).__name__}.wait: no weights with version >= {min_version} after "
                    f"{timeout_s:.1f}s (latest received: {self.latest_version}); is the trainer publishing?"
                )
            time.sleep(min(self.poll_interval_s, remaining))

    @property
    @abstractmethod
    def latest_version(self) -> int:
        """Version of the last update returned, -1 before the first."""

    def close(self) -> None:  # noqa: B027 - optional
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def state_nbytes(state_dict: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state_dict.values())


def check_version(version: int, last: int | None) -> None:
    """Versions only move forward: a publish of an older version is a bug in the caller."""
    if version < 0:
        raise ValueError(f"weight version must be >= 0, got {version}")
    if last is not None and version <= last:
        raise ValueError(f"publish(version={version}) after version {last}: versions must increase")
