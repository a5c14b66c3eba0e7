"""Run untrusted Python in a sandbox: `run_python(code) -> SandboxResult`, and `detect_isolation()`.

Owns the choice of isolation, the throwaway uids, rlimit mode's private working directory and the
cleanup after every run. The command lines come from `command.py`, the process handling from
`capture.py`. Every call starts a fresh process; nothing survives from one run to the next.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from inflight.envs.sandbox.capture import Captured, run_capped
from inflight.envs.sandbox.command import (
    SANDBOX_HOME,
    bwrap_argv,
    drop_uid_argv,
    limits_argv,
    minimal_env,
    python_argv,
    runnable_by_others,
)
from inflight.envs.sandbox.limits import Isolation, IsolationChoice, SandboxLimits
from inflight.envs.sandbox.result import RLIMIT_WARNING, SandboxResult, classify
from inflight.errors import UserError

log = logging.getLogger(__name__)

DEFAULT_LIMITS = SandboxLimits()
# Throwaway uids: far above login users and the usual subordinate-uid ranges (100000-165535+).
UID_FIRST, UID_COUNT = 1_900_000_000, 1 << 24
TOOL_PATH = "/usr/bin:/bin:/usr/sbin:/sbin:/usr/local/bin"  # the helpers must also be visible inside bwrap
PROBE_CODE = "print('ok')"
_SETUP_ERRORS = ("bwrap: ", "setpriv: ", "prlimit: ")  # how the helpers report their own failures


def run_python(
    code: str, *, stdin: str = "", limits: SandboxLimits = DEFAULT_LIMITS, isolation: IsolationChoice = "auto"
) -> SandboxResult:
    """Run `code` with `python -c` in a fresh sandboxed process and report how it ended.

    Never raises for anything the code does; raises UserError only when the requested isolation
    cannot run here. `isolation="rlimit"` is weaker (no network or filesystem isolation): the result's
    `warning` and a log line say so.
    """
    mode = resolve_isolation(isolation)
    try:
        size = len(code.encode("utf-8"))
    except UnicodeEncodeError as e:  # a lone surrogate: no process could be given this as an argument
        return SandboxResult.not_run("error", f"code is not valid text: {e}", mode)
    if size > limits.max_code_bytes:
        message = f"code is {size} bytes; the sandbox runs at most max_code_bytes={limits.max_code_bytes}"
        return SandboxResult.not_run("code_too_large", message, mode)
    if "\0" in code:
        return SandboxResult.not_run("error", "SyntaxError: source code cannot contain null bytes", mode)
    captured = _run(code, stdin.encode("utf-8", "replace"), limits, mode)
    exit_code = captured.exit_code
    if mode == "bwrap" and exit_code > 128:
        exit_code = 128 - exit_code  # bwrap reports a child killed by signal N as 128 + N
    stderr = captured.stderr.decode("utf-8", "replace")
    reason = classify(exit_code, stderr, captured.killed_for)
    if reason is not None and captured.killed_for is None and stderr.startswith(_SETUP_ERRORS):
        reason = "sandbox_error"
    return SandboxResult(
        ok=reason is None,
        exit_code=exit_code,
        reason=reason,
        stdout=captured.stdout.decode("utf-8", "replace"),
        stderr=stderr,
        truncated=captured.truncated,
        isolation=mode,
        wall_s=captured.wall_s,
        warning=RLIMIT_WARNING if mode == "rlimit" else None,
    )


def resolve_isolation(choice: IsolationChoice) -> Isolation:
    """The isolation a run with `choice` gets: "auto" is bwrap where it works here, else rlimit."""
    if choice == "auto":
        choice = detect_isolation()
        if choice == "rlimit" and os.geteuid() != 0:
            # Without root there is no throwaway uid: the code would run as us, free to signal (`kill -9
            # -1`) and read everything we own. Only an explicit choice accepts that.
            raise UserError(
                f"no safe sandbox here: {bwrap_problem()}, and without root rlimit isolation runs code as "
                "your own user; install bubblewrap, or pass isolation='rlimit' to accept that"
            )
    if choice == "bwrap":
        if problem := bwrap_problem():
            raise UserError(f"isolation='bwrap' was asked for, but bubblewrap does not work here: {problem}")
        return "bwrap"
    if choice == "rlimit":
        _warn_rlimit_once()
        return "rlimit"
    raise UserError(f"unknown sandbox isolation {choice!r}; use 'auto', 'bwrap' or 'rlimit'")


@functools.cache
def detect_isolation() -> Isolation:
    """The isolation "auto" picks: bwrap if a bubblewrap sandbox runs here (probed once), else rlimit."""
    if problem := bwrap_problem():
        log.warning("bubblewrap sandbox unavailable (%s); falling back to rlimit isolation", problem)
        return "rlimit"
    return "bwrap"


@functools.cache
def bwrap_problem() -> str | None:
    """Why a bubblewrap sandbox does not work on this machine, or None when it does."""
    if shutil.which("bwrap", path=TOOL_PATH) is None:
        return "bwrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    try:
        probe = _run(PROBE_CODE, b"", DEFAULT_LIMITS, "bwrap")
    except (OSError, UserError, RuntimeError) as e:
        return f"the probe could not start: {e}"
    if probe.exit_code != 0 or probe.stdout != b"ok\n":
        detail = probe.stderr.decode("utf-8", "replace").strip()[-500:]
        return f"the probe exited with {probe.exit_code}: {detail or '(no stderr)'}"
    return None


@functools.cache
def _warn_rlimit_once() -> None:
    log.warning("%s", RLIMIT_WARNING)
    if os.geteuid() != 0:
        log.warning(
            "rlimit isolation as a non-root user: sandboxed code runs under your own uid and can signal "
            "your processes and read your files"
        )


def _run(code: str, stdin: bytes, limits: SandboxLimits, mode: Isolation) -> Captured:
    if os.geteuid() != 0:
        return (
            _run_bwrap(code, stdin, limits, None)
            if mode == "bwrap"
            else _run_rlimit(code, stdin, limits, None)
        )
    with _lease_uid() as uid:
        return (
            _run_bwrap(code, stdin, limits, uid) if mode == "bwrap" else _run_rlimit(code, stdin, limits, uid)
        )


def _run_bwrap(code: str, stdin: bytes, limits: SandboxLimits, uid: int | None) -> Captured:
    # Killing bwrap ends the sandbox's pid namespace and so every process in it: nothing to reap.
    python = _host_python()
    inner = drop_uid_argv(_tool("setpriv"), uid) if uid is not None else []
    inner += limits_argv(_tool("prlimit"), limits, limits.max_processes) + python_argv(python, code)
    argv = bwrap_argv(_tool("bwrap"), limits, _python_dirs(python), as_root=uid is not None) + inner
    env = minimal_env(SANDBOX_HOME)  # bwrap --clearenv replaces it inside; this keeps it from bwrap too
    return run_capped(
        argv, stdin=stdin, wall_s=limits.wall_s, max_output_bytes=limits.max_output_bytes, cwd=None, env=env
    )


def _run_rlimit(code: str, stdin: bytes, limits: SandboxLimits, uid: int | None) -> Captured:
    python = _rlimit_python(as_other_uid=uid is not None)
    workdir = tempfile.mkdtemp(prefix="inflight-sandbox-")
    reap: Callable[[], None] = functools.partial(_kill_uid, uid) if uid is not None else lambda: None
    try:
        if uid is None:  # RLIMIT_NPROC then counts all of our own processes: leave room for them
            inner, max_processes = [], limits.max_processes + _count_tasks(os.getuid())
        else:
            os.chown(workdir, uid, uid)
            inner, max_processes = drop_uid_argv(_tool("setpriv"), uid), limits.max_processes
        argv = inner + limits_argv(_tool("prlimit"), limits, max_processes) + python_argv(python, code)
        try:
            return run_capped(
                argv, stdin=stdin, wall_s=limits.wall_s, max_output_bytes=limits.max_output_bytes,
                cwd=workdir, env=minimal_env(workdir), reap=reap,
            )  # fmt: skip
        finally:
            reap()  # children that left the process group (setsid) and still run
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


class _UidLeases:
    """Hands out uids that no other run of this process is using (others pick at random from 2^24)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leased: set[int] = set()
        self._rng = random.SystemRandom()

    @contextmanager
    def lease(self) -> Iterator[int]:
        with self._lock:
            while (uid := UID_FIRST + self._rng.randrange(UID_COUNT)) in self._leased:
                pass
            self._leased.add(uid)
        try:
            yield uid
        finally:
            with self._lock:
                self._leased.discard(uid)


_lease_uid = _UidLeases().lease


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid`: `kill -1` run as that uid reaches exactly the processes it owns."""
    subprocess.run(
        [_tool("kill"), "-9", "-1"],
        user=uid, group=uid, extra_groups=[], cwd="/", env={}, timeout=10,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
    )  # fmt: skip


def _count_tasks(uid: int) -> int:
    """Threads of `uid` now running: what RLIMIT_NPROC counts for an unprivileged user."""
    count = 0
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and proc.stat().st_uid == uid:
                count += len(os.listdir(proc / "task"))
        except OSError:
            continue  # the process ended while we looked
    return count


@functools.cache
def _tool(name: str) -> str:
    path = shutil.which(name, path=TOOL_PATH)
    if path is None:
        package = "bubblewrap" if name == "bwrap" else "util-linux" if name != "kill" else "procps"
        raise UserError(f"the code sandbox needs `{name}` in {TOOL_PATH}; install {package}")
    return path


def _host_python() -> str:
    # A virtualenv's python is a link to its base interpreter; the sandbox uses the base directly, so
    # the project's site-packages stay out of reach.
    return str(getattr(sys, "_base_executable", None) or sys.executable)


def _python_dirs(python: str) -> set[str]:
    """Directories the interpreter needs at run time: its installation prefix(es)."""
    return {sys.base_prefix, sys.base_exec_prefix, str(Path(os.path.realpath(python)).parent.parent)}


@functools.cache
def _rlimit_python(as_other_uid: bool) -> str:
    """An interpreter the throwaway uid can execute (e.g. not one under root's 0700 home directory)."""
    python = _host_python()
    if not as_other_uid or runnable_by_others(python):
        return python
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if runnable_by_others(candidate):
            return candidate
    raise UserError(
        f"rlimit isolation runs code as an unprivileged uid, which cannot execute {python} or "
        "/usr/bin/python3; install a system python3 or make the interpreter world-executable"
    )
