"""An engine server's side of the trainer's torch.distributed weight broadcast (`pipeline.weight_transport=
torch_dist`): on `POST /weight_broadcast/join` the server joins the trainer's group as rank k
(`weight_sync/torch_dist.py`'s receiver: announcements through the trainer's TCP store, bucketed flat
buffers over gloo) and installs every whole update it receives into its engine loop, between two decode
steps like any other update. The trainer learns that an update is live from /health's version. Knows
nothing of HTTP or of who publishes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from inflight.types import WeightUpdate
from inflight.weight_sync.torch_dist import TorchDistReceiver, TorchDistSyncConfig

log = logging.getLogger(__name__)
_WAIT_S = 1.0  # how often the listener looks at its stop flag between updates


class BroadcastListener:
    """One membership at a time: joining again (a trainer that restarted) leaves the previous group."""

    def __init__(self, install: Callable[[WeightUpdate], None]) -> None:
        self._install = install
        self._lock = threading.Lock()
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self.error: str | None = None  # why the last membership ended, if it failed
        self.received = 0  # updates received and handed to the engine, over every membership

    def join(self, config: TorchDistSyncConfig, rank: int) -> None:
        """Leave any previous group and join this one in a thread of its own (joining waits for every
        rank, the trainer included, so the caller returns at once)."""
        if not 1 <= rank < config.world_size:
            raise ValueError(f"rank {rank} is not a receiver of a group of {config.world_size} (1..N-1)")
        self.close()
        stop = threading.Event()
        thread = threading.Thread(target=self._run, args=(config, rank, stop), name="weight-broadcast")
        thread.daemon = True
        with self._lock:
            self._stop, self._thread, self.error = stop, thread, None
        thread.start()

    def close(self) -> None:
        with self._lock:
            stop, thread = self._stop, self._thread
            self._stop = self._thread = None
        if stop is not None and thread is not None:
            stop.set()
            thread.join(timeout=5)

    def _run(self, config: TorchDistSyncConfig, rank: int, stop: threading.Event) -> None:
        receiver: TorchDistReceiver | None = None
        try:
            receiver = TorchDistReceiver(config, rank)
            version = -1
            while not stop.is_set():
                try:
                    update = receiver.wait(version + 1, timeout_s=_WAIT_S)
                except TimeoutError:
                    if receiver.stopped:  # the trainer closed the group
                        return
                    continue
                version = update.version
                self._install(update)
                self.received += 1
        except Exception as exc:  # the membership's end, reported in /metrics and the log
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("weight broadcast (rank %d of %d) ended: %s", rank, config.world_size, self.error)
        finally:
            if receiver is not None:
                receiver.close()
