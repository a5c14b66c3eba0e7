"""In-process weight sync: the trainer and the engine share a process; a publish is one copy into a slot.

The copy is what makes a version exact: the trainer's tensors change at its next optimizer step, so the
receiver must never hold views of them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

import torch

from inflight.types import WeightUpdate
from inflight.weight_sync.base import (
    PublishStats,
    WeightPublisher,
    WeightReceiver,
    check_version,
    state_nbytes,
)


class InProcessChannel:
    """The slot both sides share: the latest published update and a condition to wait on."""

    def __init__(self) -> None:
        self.latest: WeightUpdate | None = None
        self.changed = threading.Condition()

    def publisher(self) -> InProcessPublisher:
        return InProcessPublisher(self)

    def receiver(self) -> InProcessReceiver:
        return InProcessReceiver(self)


class InProcessPublisher(WeightPublisher):
    def __init__(self, channel: InProcessChannel) -> None:
        self._channel = channel
        self._last_version: int | None = None

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> PublishStats:
        check_version(version, self._last_version)
        t0 = time.perf_counter()
        with torch.no_grad():
            snapshot = {name: t.detach().clone() for name, t in state_dict.items()}
        with self._channel.changed:
            self._channel.latest = WeightUpdate(version, snapshot)
            self._channel.changed.notify_all()
        self._last_version = version
        self.last_stats = PublishStats(
            version, state_nbytes(snapshot), len(snapshot), time.perf_counter() - t0
        )
        return self.last_stats


class InProcessReceiver(WeightReceiver):
    def __init__(self, channel: InProcessChannel) -> None:
        self._channel = channel
        self._version = -1

    @property
    def latest_version(self) -> int:
        return self._version

    def poll(self) -> WeightUpdate | None:
        with self._channel.changed:
            return self._take()

    def wait(self, min_version: int, timeout_s: float) -> WeightUpdate:
        deadline = time.monotonic() + timeout_s
        with self._channel.changed:
            while True:
                latest = self._channel.latest
                if latest is not None and latest.version >= min_version and latest.version > self._version:
                    update = self._take()
                    assert update is not None
                    return update
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"InProcessReceiver.wait: no weights with version >= {min_version} after "
                        f"{timeout_s:.1f}s (latest received: {self._version}); is the trainer publishing?"
                    )
                self._channel.changed.wait(remaining)

    def _take(self) -> WeightUpdate | None:
        latest = self._channel.latest
        if latest is None or latest.version <= self._version:
            return None
        self._version = latest.version
        # Receivers share the snapshot: engines copy what they keep (Engine.update_weights contract).
        return latest
