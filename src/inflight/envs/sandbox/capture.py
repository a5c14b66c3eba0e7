"""Run one command with a wall-clock deadline and a byte cap on stdout and stderr.

Owns the process's life: start in a new session, feed stdin, read both pipes without blocking, kill the
whole process group on a deadline or an overflow. Knows nothing of Python, uids or namespaces; the caller
passes `reap` to kill what a process group cannot reach (e.g. a child that called setsid()).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Literal

KillReason = Literal["timeout", "output_limit"]
READ_CHUNK_BYTES = 1 << 16
POLL_S = 0.1  # how often a live run checks whether its main process already exited
DRAIN_AFTER_KILL_S = 5.0  # after a kill, how long to wait for the pipes to close before giving up on them


@dataclass
class Captured:
    exit_code: int  # negative: killed by that signal (subprocess's convention)
    stdout: bytes
    stderr: bytes
    truncated: bool
    killed_for: KillReason | None
    wall_s: float
    # CPU time of the main process and of the descendants it waited for (wait4). Covers the whole job
    # only when the main process is the code itself, not bwrap, which does not pass its child's on.
    cpu_s: float


def run_capped(
    argv: list[str],
    *,
    stdin: bytes,
    wall_s: float,
    max_output_bytes: int,
    cwd: str | None,
    env: dict[str, str],
    reap: Callable[[], None] = lambda: None,
    pass_fds: tuple[int, ...] = (),
) -> Captured:
    """Run `argv` to its end, or kill it at `wall_s` or when a stream passes `max_output_bytes`."""
    start = time.monotonic()
    deadline = start + wall_s
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env=env,
        pass_fds=pass_fds,
        start_new_session=True,  # its own process group, so one killpg reaches every descendant left in it
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    buffers: dict[IO[bytes], bytearray] = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    truncated, killed_for, killed_at, reaped = False, None, None, False
    pending = memoryview(stdin)

    def kill(reason: KillReason | None) -> None:
        nonlocal killed_for, killed_at
        killed_for = killed_for or reason
        if killed_at is None:
            killed_at = time.monotonic()
            _killpg(proc.pid)
            reap()

    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        selector.register(proc.stderr, selectors.EVENT_READ)
        if pending:
            os.set_blocking(proc.stdin.fileno(), False)
            selector.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        while selector.get_map():
            now = time.monotonic()
            if now >= deadline and killed_at is None:
                kill("timeout")
            if killed_at is not None and now - killed_at > DRAIN_AFTER_KILL_S:
                break  # something unkillable holds the pipes: stop reading rather than hang
            events = selector.select(timeout=POLL_S if killed_at else min(POLL_S, max(deadline - now, 0.0)))
            if not events and not reaped and killed_at is None and _exited(proc.pid):
                # The main process ended but descendants still hold the pipes open, which would keep
                # us reading until the deadline: end them now.
                reaped = True
                _killpg(proc.pid)
                reap()
            for key, _ in events:
                stream: IO[bytes] = key.fileobj  # type: ignore[assignment]
                if stream is proc.stdin:
                    pending = _write_some(selector, stream, pending)
                    continue
                data = os.read(stream.fileno(), READ_CHUNK_BYTES)
                if not data:
                    selector.unregister(stream)
                    continue
                buffer = buffers[stream]
                room = max_output_bytes - len(buffer)
                buffer += data[:room]
                if len(data) > room:
                    truncated = True
                    kill("output_limit")
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        stream.close()
    # Usually the process has already exited; one that closed its pipes and ran on ends at the deadline.
    waited = _wait(proc, until=deadline if killed_at is None else time.monotonic() + DRAIN_AFTER_KILL_S)
    if waited is None:
        kill("timeout")
        waited = _wait(proc, until=time.monotonic() + DRAIN_AFTER_KILL_S)
    if waited is None:
        raise RuntimeError(
            f"sandbox process {proc.pid} did not exit within {DRAIN_AFTER_KILL_S:g} s of SIGKILL"
        )
    exit_code, cpu_s = waited
    stdout, stderr = bytes(buffers[proc.stdout]), bytes(buffers[proc.stderr])
    return Captured(exit_code, stdout, stderr, truncated, killed_for, time.monotonic() - start, cpu_s)


def _write_some(selector: selectors.BaseSelector, stream: IO[bytes], pending: memoryview) -> memoryview:
    """Write what the pipe takes now; close stdin once all is written or the reader is gone."""
    try:
        pending = pending[os.write(stream.fileno(), pending[:READ_CHUNK_BYTES]) :]
    except (BrokenPipeError, BlockingIOError) as e:
        if isinstance(e, BlockingIOError):
            return pending
        pending = pending[:0]
    if not pending:
        selector.unregister(stream)
        stream.close()
    return pending


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(pgid, signal.SIGKILL)


def _exited(pid: int) -> bool:
    """Whether `pid` has exited, leaving it unreaped (WNOWAIT) for `_wait` to collect its CPU time."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _wait(proc: subprocess.Popen[bytes], *, until: float) -> tuple[int, float] | None:
    """The exit code and CPU seconds of `proc` once it exits, or None if it still runs at `until`."""
    delay_s = 0.0005
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)  # Popen must not wait for it again
            return proc.returncode, usage.ru_utime + usage.ru_stime
        if time.monotonic() >= until:
            return None
        time.sleep(delay_s)
        delay_s = min(2 * delay_s, POLL_S)
