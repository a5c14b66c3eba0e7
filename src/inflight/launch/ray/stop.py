"""A stop asked of the launcher (a signal), carried to the run's actor through Ray's key-value store, where
its `StopWatch` reads it. Knows nothing of what the run does once stopped (`orchestrator/stopping.py`)."""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any

from inflight.config import RunConfig

if TYPE_CHECKING:
    from inflight.orchestrator.stopping import StopRequest

STOP_POLL_S = 0.5  # how often the launcher forwards, and the run's actor reads, a stop (a signal)
STOP_NAMESPACE = "inflight"


def kv_store() -> Any:
    """Ray's cluster-wide key-value store (the GCS's), as Ray's own libraries use it: the one channel from
    the launcher to a running plain (single-threaded) actor that needs no actor, thread or file of its own."""
    from ray.experimental import internal_kv

    return internal_kv


def stop_key_for(cfg: RunConfig) -> str:
    return f"stop:{cfg.run_dir}"


class StopWatch:
    """In the run's actor: a thread that reads the launcher's stop request (`stop_key_for`) every
    STOP_POLL_S and sets the run's StopRequest with it."""

    def __init__(self, key: str) -> None:
        from inflight.orchestrator.stopping import StopRequest

        self.key, self.stop = key, StopRequest()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="inflight-stop-watch", daemon=True)

    def __enter__(self) -> StopRequest:
        self._thread.start()
        return self.stop

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(5)

    def _loop(self) -> None:
        kv = kv_store()
        while not self._done.wait(STOP_POLL_S):
            with contextlib.suppress(Exception):  # the GCS briefly away: ask again next time
                reason = kv._internal_kv_get(self.key, namespace=STOP_NAMESPACE)
                if reason is not None:
                    self.stop.set(reason.decode())
                    return
