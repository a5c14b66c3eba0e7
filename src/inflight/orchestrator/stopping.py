"""A stop asked of a run from outside it: Ctrl-C or SIGTERM (a scheduler's preemption) during `inflight run`.

The first signal sets a `StopRequest`; the training loops (`sync_loop.py`, `pipeline.py`) finish the step in
flight, and the run then writes its checkpoint, evaluates and writes its summary as a finished run does,
with `stopped` naming the signal, so the same command resumes it (`run_dir=...`); one that comes before the
first step (during the initial evaluation) trains none (`run.py`). A second signal is the
old immediate exit (KeyboardInterrupt): nothing more is written, and the last periodic checkpoint is what a
resume finds. Under `launcher=ray` the launcher forwards the request to the run's actor; one that comes
while Ray still places the actors ends the placement (`StoppedBeforeRun`).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Set once, from any thread (or a signal handler); read by the loops between steps."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason: str | None = None  # the signal's name, e.g. "SIGTERM"

    def set(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float) -> bool:
        return self._event.wait(timeout_s)


class StoppedBeforeRun(Exception):
    """A stop that came while a launcher was still preparing the run (under launcher=ray: while Ray placed
    its actors): nothing ran and nothing was written, so the same command starts the run afresh. Its
    message is the one line for stderr; the command exits as the signal says (130 / 143)."""

    def __init__(self, reason: str, during: str) -> None:
        super().__init__(
            f"{reason}: stopped while {during}; nothing ran or was written (the same command starts the run)"
        )
        self.exit_code = 128 + signal.Signals[reason].value


@contextlib.contextmanager
def stop_on_signals(stop: StopRequest) -> Iterator[StopRequest]:
    """Within: SIGINT and SIGTERM set `stop` (with one line on stderr), and a second one raises
    KeyboardInterrupt. The previous handlers come back on exit. Main thread only (Python's rule for
    signal handlers); elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set(name)
        print(
            f"inflight: {name}: stopping after the step in flight (of the warm-up or the training; "
            "before the first step, once the initial evaluation ends), then saving what the same command "
            "continues from, and the summary; send it again to quit at once",
            file=sys.stderr,
            flush=True,
        )

    previous = {signum: signal.signal(signum, handle) for signum in SIGNALS}
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
