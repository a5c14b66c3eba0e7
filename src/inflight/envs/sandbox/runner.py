"""Run untrusted Python in a sandbox: `run_python(code) -> SandboxResult`, and `detect_isolation()`.

Owns the choice of isolation, the throwaway uids, each run's job cgroup and seccomp program, rlimit
mode's private working directory and the cleanup after every run. The command lines come from
`command.py`, the process handling from `capture.py`, the memory bound from `memory_bound.py`. Every
call starts a fresh process; nothing survives from one run to the next.
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
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from inflight.envs.sandbox.capture import Captured, run_capped
from inflight.envs.sandbox.cgroup import JobCgroup, JobUsage, job_cgroup
from inflight.envs.sandbox.command import (
    SANDBOX_HOME,
    bwrap_argv,
    drop_uid_argv,
    enter_cgroup_argv,
    limits_argv,
    minimal_env,
    python_argv,
    runnable_by_others,
    seccomp_loader_argv,
)
from inflight.envs.sandbox.limits import (
    Isolation,
    IsolationChoice,
    MemoryBound,
    MemoryBoundChoice,
    SandboxLimits,
)
from inflight.envs.sandbox.memory_bound import (
    ProcessBudget,
    cgroup_tasks,
    detect_memory_bound,
    job_layout,
    process_budget,
    resolve_memory_bound,
)
from inflight.envs.sandbox.result import RLIMIT_WARNING, SandboxResult, classify
from inflight.envs.sandbox.seccomp import filter_program
from inflight.errors import UserError

log = logging.getLogger(__name__)

DEFAULT_LIMITS = SandboxLimits()
# Throwaway uids: far above login users and the usual subordinate-uid ranges (100000-165535+).
UID_FIRST, UID_COUNT = 1_900_000_000, 1 << 24
TOOL_PATH = "/usr/bin:/bin:/usr/sbin:/sbin:/usr/local/bin"  # the helpers must also be visible inside bwrap
PROBE_CODE = "print('ok')"
# How the helpers report their own failures (the seccomp loader's prefix is in seccomp.LOADER_CODE).
_SETUP_ERRORS = ("sh: ", "bwrap: ", "seccomp: ", "setpriv: ", "prlimit: ")


@dataclass(frozen=True)
class _Ran:
    captured: Captured
    usage: JobUsage


def run_python(
    code: str,
    *,
    stdin: str = "",
    limits: SandboxLimits = DEFAULT_LIMITS,
    isolation: IsolationChoice = "auto",
    memory_bound: MemoryBoundChoice = "auto",
) -> SandboxResult:
    """Run `code` with `python -c` in a fresh sandboxed process and report how it ended.

    Never raises for anything the code does; raises UserError only when the requested isolation or
    memory bound cannot run here. `isolation="rlimit"` is weaker (no network or filesystem
    isolation): the result's `warning` and a log line say so. The result's `memory_bound` says how
    the job's memory was bounded as a whole (see memory_bound.py).
    """
    mode = resolve_isolation(isolation)
    bound = resolve_memory_bound(memory_bound)
    try:
        size = len(code.encode("utf-8"))
    except UnicodeEncodeError as e:  # a lone surrogate: no process could be given this as an argument
        return SandboxResult.not_run("error", f"code is not valid text: {e}", mode)
    if size > limits.max_code_bytes:
        message = f"code is {size} bytes; the sandbox runs at most max_code_bytes={limits.max_code_bytes}"
        return SandboxResult.not_run("code_too_large", message, mode)
    if "\0" in code:
        return SandboxResult.not_run("error", "SyntaxError: source code cannot contain null bytes", mode)
    ran = _run(code, stdin.encode("utf-8", "replace"), limits, mode, bound)
    captured, usage = ran.captured, ran.usage
    exit_code = captured.exit_code
    if mode == "bwrap" and exit_code > 128:
        exit_code = 128 - exit_code  # bwrap reports a child killed by signal N as 128 + N
    stderr = captured.stderr.decode("utf-8", "replace")
    reason = classify(
        exit_code,
        stderr,
        captured.killed_for,
        oom_killed=usage.oom_kills > 0,
        cpu_limit_reached=usage.cpu_s is not None and usage.cpu_s >= limits.cpu_s,
    )
    if reason is not None and captured.killed_for is None and stderr.startswith(_SETUP_ERRORS):
        reason = "sandbox_error"
    peak = usage.memory_peak_bytes
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
        memory_bound=bound,
        memory_peak_mb=round(peak / (1 << 20), 1) if peak is not None else None,
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
        probe = _run(PROBE_CODE, b"", DEFAULT_LIMITS, "bwrap", detect_memory_bound()).captured
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


@dataclass(frozen=True)
class _Job:
    """How one run is confined, whichever isolation runs it."""

    limits: SandboxLimits
    uid: int | None  # the throwaway uid (when we are root)
    budget: ProcessBudget
    prefix: list[str]  # joins the job's cgroup, if it has one
    seccomp_fd: int
    reap: Callable[[], None]  # kills what is left of the job


def _run(code: str, stdin: bytes, limits: SandboxLimits, mode: Isolation, bound: MemoryBound) -> _Ran:
    layout = job_layout(bound)
    with ExitStack() as stack:
        uid = stack.enter_context(_lease_uid()) if os.geteuid() == 0 else None
        group: JobCgroup | None = None
        if layout is not None:
            group = stack.enter_context(
                job_cgroup(layout, memory_bytes=limits.memory_mb << 20, max_tasks=cgroup_tasks(limits, mode))
            )
        seccomp_fd = stack.enter_context(_seccomp_fd())
        job = _Job(
            limits=limits,
            uid=uid,
            budget=process_budget(limits, bound),
            prefix=enter_cgroup_argv(_tool("sh"), group.procs_files) if group else [],
            seccomp_fd=seccomp_fd,
            reap=functools.partial(_reap, group, uid),
        )
        captured = _run_bwrap(code, stdin, job) if mode == "bwrap" else _run_rlimit(code, stdin, job)
        if group is not None:
            return _Ran(captured, group.usage())  # read before leaving the stack removes the group
    # No cgroup: wait4's CPU time covers the job in rlimit mode, where the code is the main process.
    return _Ran(captured, JobUsage(0, captured.cpu_s if mode == "rlimit" else None, None))


def _run_bwrap(code: str, stdin: bytes, job: _Job) -> Captured:
    # Killing bwrap ends the sandbox's pid namespace and so every process in it; `reap` is a backstop.
    python = _host_python()
    inner = drop_uid_argv(_tool("setpriv"), job.uid) if job.uid is not None else []
    inner += _limits_argv(job, job.budget.max_tasks) + python_argv(python, code)
    sandbox = bwrap_argv(
        _tool("bwrap"),
        job.limits,
        _python_dirs(python),
        as_root=job.uid is not None,
        seccomp_fd=job.seccomp_fd,
    )
    env = minimal_env(SANDBOX_HOME)  # bwrap --clearenv replaces it inside; this keeps it from bwrap too
    return run_capped(
        job.prefix + sandbox + inner, stdin=stdin, wall_s=job.limits.wall_s,
        max_output_bytes=job.limits.max_output_bytes, cwd=None, env=env, reap=job.reap,
        pass_fds=(job.seccomp_fd,),
    )  # fmt: skip


def _run_rlimit(code: str, stdin: bytes, job: _Job) -> Captured:
    python = _rlimit_python(as_other_uid=job.uid is not None)
    workdir = tempfile.mkdtemp(prefix="inflight-sandbox-")
    try:
        if job.uid is None:  # RLIMIT_NPROC then counts all of our own processes: leave room for them
            inner, max_tasks = [], job.budget.max_tasks + _count_tasks(os.getuid())
        else:
            os.chown(workdir, job.uid, job.uid)
            inner, max_tasks = drop_uid_argv(_tool("setpriv"), job.uid), job.budget.max_tasks
        argv = job.prefix + seccomp_loader_argv(python, job.seccomp_fd) + inner
        argv += _limits_argv(job, max_tasks) + python_argv(python, code)
        try:
            return run_capped(
                argv, stdin=stdin, wall_s=job.limits.wall_s, max_output_bytes=job.limits.max_output_bytes,
                cwd=workdir, env=minimal_env(workdir), reap=job.reap, pass_fds=(job.seccomp_fd,),
            )  # fmt: skip
        finally:
            job.reap()  # children that left the process group (setsid) and still run
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _limits_argv(job: _Job, max_tasks: int) -> list[str]:
    return limits_argv(
        _tool("prlimit"), job.limits, max_tasks=max_tasks, address_space_mb=job.budget.address_space_mb
    )


def _reap(group: JobCgroup | None, uid: int | None) -> None:
    if group is not None:
        group.kill()
    if uid is not None:
        _kill_uid(uid)


@contextmanager
def _seccomp_fd() -> Iterator[int]:
    """A pipe holding the seccomp program, which bwrap or the loader reads whole in the job."""
    read_fd, write_fd = os.pipe()
    try:
        program = filter_program()
        # Far below PIPE_BUF (4 KiB): one write puts it all in the pipe, and the reader sees EOF after it.
        if os.write(write_fd, program) != len(program):
            raise RuntimeError("the seccomp program did not fit in one pipe write")
    finally:
        os.close(write_fd)
    try:
        yield read_fd
    finally:
        os.close(read_fd)


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
        package = {"bwrap": "bubblewrap", "kill": "procps", "sh": "dash"}.get(name, "util-linux")
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
