"""What one sandboxed execution returned, and why it failed: `SandboxResult` and `classify`.

Owns the vocabulary of failure reasons; knows nothing of processes (the runner passes in what it saw).
"""

from __future__ import annotations

import re
import signal
from typing import Literal

from pydantic import BaseModel, ConfigDict

from inflight.envs.sandbox.limits import Isolation, MemoryBound

Reason = Literal[
    "error",  # exited nonzero (an uncaught exception, a failed assert, sys.exit(1))
    "timeout",  # ran past wall_s: the whole process tree was killed
    "cpu",  # a process used cpu_s of CPU time (SIGXCPU, or SIGKILL at the hard limit)
    "memory",  # an allocation failed (MemoryError), or the kernel killed a process at the job's memory_mb
    "processes",  # fork/thread creation refused under max_processes
    "output_limit",  # wrote more than max_output_bytes to stdout or stderr: killed
    "disk_limit",  # a file grew past max_file_mb, or the private /tmp filled up
    "network",  # a connection or name lookup failed (there is no network in the sandbox)
    "filesystem",  # a path outside the private /tmp was missing, hidden or read-only
    "permission",  # the kernel refused an operation (e.g. signalling a process outside the sandbox)
    "killed",  # ended by a signal the sandbox did not send
    "code_too_large",  # the code exceeded max_code_bytes and was not run
    "sandbox_error",  # the sandbox itself failed to start; the code may never have run
]

RLIMIT_WARNING = (
    "rlimit isolation: resource limits only; no network or filesystem isolation (the code can reach the "
    "network and read every world-readable file). Install bubblewrap (bwrap) for full isolation."
)

# The last line of a Python traceback: `Name: message` or a bare `Name`.
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*)(?::\s*(.*))?$")
_ERRNO = re.compile(r"\[Errno (-?\d+)\]")
_NETWORK_EXCEPTIONS = {"ConnectionRefusedError", "ConnectionResetError", "ConnectionAbortedError"}
_NETWORK_EXCEPTIONS |= {"socket.gaierror", "gaierror", "socket.herror", "urllib.error.URLError"}
_NETWORK_ERRNOS = {99, 101, 110, 111, 113, -2, -3, -5}  # EADDRNOTAVAIL ENETUNREACH ETIMEDOUT ECONN...
_FILESYSTEM_ERRNOS = {2, 13, 20, 21, 30}  # ENOENT EACCES ENOTDIR EISDIR EROFS
_DISK_ERRNOS = {27, 28, 122}  # EFBIG (RLIMIT_FSIZE) ENOSPC (tmpfs full) EDQUOT


class SandboxResult(BaseModel):
    """One execution. `ok` means exit code 0 within every limit; otherwise `reason` says why not."""

    model_config = ConfigDict(frozen=True)

    ok: bool
    exit_code: int | None  # negative: killed by that signal; None: never started
    reason: Reason | None  # None exactly when ok
    stdout: str
    stderr: str
    truncated: bool  # stdout or stderr was cut at max_output_bytes
    isolation: Isolation
    wall_s: float
    warning: str | None = None  # set when the isolation is weaker than bwrap's
    memory_bound: MemoryBound | None = None  # how the job's memory was bounded; None: it never ran
    memory_peak_mb: float | None = None  # the job's peak, all processes together (cgroup bounds only)

    @classmethod
    def not_run(cls, reason: Reason, message: str, isolation: Isolation) -> SandboxResult:
        """A failure before or instead of running the code (too large, pool timeout, sandbox failure)."""
        warning = RLIMIT_WARNING if isolation == "rlimit" else None
        return cls(
            ok=False, exit_code=None, reason=reason, stdout="", stderr=message + "\n", truncated=False,
            isolation=isolation, wall_s=0.0, warning=warning,
        )  # fmt: skip

    @property
    def output(self) -> str:
        """stdout then stderr, as a tool call shows them to a model."""
        return self.stdout + self.stderr


def _last_exception_line(stderr: str) -> str | None:
    """The last traceback's `Name: message` line: the last line that is neither indented nor a header.

    Not simply the last line: the forked children of a job share its stderr, and their tracebacks
    interleave (a fork bomb's stderr may end on another child's `  File "<string>", line 3`).
    """
    for line in reversed(stderr.splitlines()):
        if line.strip() and not line[0].isspace() and line != "Traceback (most recent call last):":
            return line.strip()
    return None


def classify(
    exit_code: int,
    stderr: str,
    killed_for: Reason | None = None,
    *,
    oom_killed: bool = False,
    cpu_limit_reached: bool = False,
) -> Reason | None:
    """Why an execution failed (None if it did not), from its exit code and the traceback on stderr.

    `killed_for` is the reason the runner itself killed the process tree, which always wins; then
    `oom_killed` (the kernel killed one of the job's processes at its memory limit, whatever the exit
    code). `cpu_limit_reached` (the job used cpu_s of CPU time) tells a SIGKILL at the hard CPU limit
    from other SIGKILLs. A reason read from a traceback is the sandbox's best reading, not a proof:
    e.g. code that raises MemoryError itself is reported as "memory".
    """
    if killed_for is not None:
        return killed_for
    if oom_killed:
        return "memory"
    if exit_code == 0:
        return None
    if exit_code < 0:
        signo = -exit_code
        if signo == signal.SIGXCPU or (signo == signal.SIGKILL and cpu_limit_reached):
            return "cpu"
        return "disk_limit" if signo == signal.SIGXFSZ else "killed"
    line = _last_exception_line(stderr)
    match = _EXCEPTION.match(line) if line is not None else None
    if match is None:
        return "error"
    name, message = match.group(1), match.group(2) or ""
    errno_match = _ERRNO.search(message)
    errno = int(errno_match.group(1)) if errno_match else None
    if name == "MemoryError":
        return "memory"
    if (name == "BlockingIOError" and errno == 11) or "can't start new thread" in message:
        return "processes"
    if name in _NETWORK_EXCEPTIONS or errno in _NETWORK_ERRNOS:
        return "network"
    if errno in _DISK_ERRNOS:
        return "disk_limit"
    if errno == 1:  # EPERM: e.g. os.kill of a process outside the sandbox
        return "permission"
    if errno in _FILESYSTEM_ERRNOS:
        return "filesystem"
    return "error"
