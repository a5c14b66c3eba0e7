"""Hostile code in the sandbox: each attack from issue 5 and the hardening issue is contained, reported as
a failed run with its reason, and the sandbox still works afterwards (checked after every test).

References: bubblewrap(1); setrlimit(2) and kill(2) (`kill(-1)` reaches every process the caller may
signal: its own uid's); proc(5) (/proc/PID/environ needs ptrace access); cgroups(7) and the kernel's
cgroup-v1/memory.rst (a group's limit covers all its processes; oom_kill counts the kernel's kills);
seccomp(2) and unshare(2). rlimit mode has no network or filesystem isolation by design, so the network
test and the private-/tmp checks are bwrap-only. Like the rest of this file, the job-cgroup tests run
in CI (root, a cgroup v1 memory hierarchy) and fail there rather than skip.
"""

from __future__ import annotations

import ast
import json
import os
import platform
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from inflight.envs.sandbox import (
    IsolationChoice,
    MemoryBoundChoice,
    SandboxLimits,
    SandboxResult,
    bwrap_problem,
    detect_memory_bound,
    run_python,
    runner,
)
from inflight.envs.sandbox.cgroup import GROUP_PREFIX, cgroup_layout
from inflight.envs.sandbox.pool import VerifierPool
from inflight.envs.sandbox.seccomp import CLONE_SYSCALLS, DENIED_SYSCALLS

HOSTILE = SandboxLimits(wall_s=15, cpu_s=5, memory_mb=256, max_processes=16, max_output_bytes=1 << 20)


def _require(isolation: str) -> None:
    if isolation == "bwrap" and (problem := bwrap_problem()):
        if os.environ.get("CI"):
            pytest.fail(f"bubblewrap must work in CI: {problem}")
        pytest.skip(f"bubblewrap does not work here: {problem}")
    if os.geteuid() != 0:  # without root the code would run as the test runner: `kill -9 -1` would hit it
        if os.environ.get("CI"):
            pytest.fail("CI must run the sandbox security tests as root")
        pytest.skip("the security tests need root (a throwaway uid per run)")


@pytest.fixture(params=["bwrap", "rlimit"])
def isolation(request: pytest.FixtureRequest) -> Iterator[IsolationChoice]:
    _require(request.param)
    yield cast(IsolationChoice, request.param)
    after = run_python("print('still works')", isolation=request.param)
    assert after.ok and after.stdout == "still works\n", f"the sandbox broke after the attack: {after}"


@pytest.fixture
def bwrap() -> Iterator[IsolationChoice]:
    _require("bwrap")
    yield "bwrap"
    assert run_python("print(1)", isolation="bwrap").ok


def _require_job_cgroup() -> None:
    if detect_memory_bound() == "rlimit_split":
        problem = cgroup_layout()
        if os.environ.get("CI"):
            pytest.fail(f"CI must bound sandbox jobs with a cgroup: {problem}")
        pytest.skip(f"no job cgroup can be made here: {problem}")


def _run(
    code: str,
    isolation: IsolationChoice,
    limits: SandboxLimits = HOSTILE,
    memory_bound: MemoryBoundChoice = "auto",
) -> SandboxResult:
    return run_python(code, limits=limits, isolation=isolation, memory_bound=memory_bound)


def _leftover_job_groups() -> list[Path]:
    layout = cgroup_layout()
    if isinstance(layout, str):
        return []
    parents = {layout.memory, layout.pids, layout.cpu} - {None}
    return [path for parent in parents if parent for path in parent.glob(f"{GROUP_PREFIX}{os.getpid()}-*")]


def _live_processes_running(token: str) -> list[int]:
    """Pids whose command line holds `token` and that are not zombies (a zombie holds no resources)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or token.encode() not in (proc / "cmdline").read_bytes():
                continue
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def test_network_connection_is_refused(bwrap: IsolationChoice) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    code = (
        f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=3)\ns.sendall(b'leak')"
    )
    result = _run(code, bwrap)
    with listener, pytest.raises(TimeoutError):
        listener.accept()  # nothing ever reached the host's loopback
    assert (result.ok, result.reason) == (False, "network"), result.stderr
    outside = _run("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=3)", bwrap)
    assert (outside.ok, outside.reason) == (False, "network"), outside.stderr
    lookup = _run("import socket\nsocket.getaddrinfo('pypi.org', 443)", bwrap)
    assert (lookup.ok, lookup.reason) == (False, "network"), lookup.stderr


def test_rlimit_mode_warns_that_the_network_is_open(isolation: IsolationChoice) -> None:
    result = _run("print('hi')", isolation)
    assert result.ok
    assert (result.warning is not None and "no network" in result.warning) == (isolation == "rlimit")


def test_writes_outside_the_private_directory_fail(isolation: IsolationChoice, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o755)
    for target in (victim / "pwned", Path(sys.prefix) / "pwned", Path("/usr/pwned")):
        result = _run(f"open({str(target)!r}, 'w').write('pwned')", isolation)
        assert (result.ok, result.reason) == (False, "filesystem"), (target, result.stderr)
        assert not target.exists()
    if isolation == "bwrap":  # its /tmp is a private tmpfs: writing there succeeds and leaves nothing behind
        escape = Path("/tmp") / f"inflight-escape-{secrets.token_hex(8)}"
        assert _run(f"open({str(escape)!r}, 'w').write('x')", isolation).ok
        assert not escape.exists()


def test_host_environment_is_not_visible(isolation: IsolationChoice, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = secrets.token_hex(16)
    monkeypatch.setenv("INFLIGHT_TEST_SECRET", secret)
    code = "import os\nprint(sorted(os.environ))\nprint(open(f'/proc/{os.getppid()}/environ').read())"
    result = _run(code, isolation)
    assert (result.ok, result.reason) == (False, "filesystem"), result.stderr
    assert secret not in result.stdout + result.stderr
    assert set(ast.literal_eval(result.stdout)) <= {"HOME", "LANG", "PATH", "TMPDIR", "PWD"}, result.stdout
    direct = _run("import os\nprint(os.environ['INFLIGHT_TEST_SECRET'])", isolation)
    assert (direct.ok, direct.reason) == (False, "error") and "KeyError" in direct.stderr


def test_host_home_directory_is_not_readable(
    isolation: IsolationChoice, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_home = Path.home()
    fake_home = tmp_path / "home"
    fake_home.mkdir()
    secret = secrets.token_hex(16)
    (fake_home / ".secret").write_text(secret)
    monkeypatch.setenv("HOME", str(fake_home))
    for path in ("~/.secret", str(fake_home / ".secret")):
        result = _run(f"import os\nprint(open(os.path.expanduser({path!r})).read())", isolation)
        assert (result.ok, result.reason) == (False, "filesystem"), (path, result.stderr)
        assert secret not in result.stdout
    # The real home: unreadable (rlimit), or showing nothing but the Python installation (bwrap).
    listing = _run(f"import os\nprint(sorted(os.listdir({str(real_home)!r})))", isolation)
    python_dirs = (
        {Path(sys.base_prefix).relative_to(real_home).parts[0]}
        if Path(sys.base_prefix).is_relative_to(real_home)
        else set()
    )
    if listing.ok:
        assert isolation == "bwrap" and set(ast.literal_eval(listing.stdout)) <= python_dirs, listing.stdout
    else:
        assert listing.reason == "filesystem", listing.stderr


@pytest.mark.parametrize("memory_bound", ["auto", "rlimit_split"])
def test_fork_bomb_is_contained(isolation: IsolationChoice, memory_bound: MemoryBoundChoice) -> None:
    token = secrets.token_hex(8)
    result = _run(f"import os  # {token}\nwhile True:\n    os.fork()", isolation, memory_bound=memory_bound)
    assert (result.ok, result.reason) == (False, "processes"), result.stderr
    assert _live_processes_running(token) == []  # every copy is gone, not just the first
    assert _leftover_job_groups() == []


def test_fork_bomb_that_survives_fork_failures_is_killed_at_the_deadline(isolation: IsolationChoice) -> None:
    token = secrets.token_hex(8)
    code = (
        f"import os  # {token}\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    )
    result = _run(code, isolation, HOSTILE.model_copy(update={"wall_s": 3.0, "cpu_s": 60}))
    assert (result.ok, result.reason) == (False, "timeout")
    assert _live_processes_running(token) == []


def test_memory_bomb_is_contained(isolation: IsolationChoice) -> None:
    result = _run("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 24))", isolation)
    assert (result.ok, result.reason) == (False, "memory"), result.stderr


def test_infinite_loop_is_stopped_by_cpu_or_wall_limit(isolation: IsolationChoice) -> None:
    one_cpu_s = HOSTILE.model_copy(update={"cpu_s": 1, "wall_s": 60})
    by_cpu = _run("while True:\n    pass", isolation, one_cpu_s)
    assert (by_cpu.ok, by_cpu.reason) == (False, "cpu")
    # Ignoring SIGXCPU only delays the end to the hard limit's SIGKILL, which is still the CPU limit.
    stubborn = _run(
        "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass",
        isolation,
        one_cpu_s,
    )
    assert (stubborn.ok, stubborn.reason, stubborn.exit_code) == (False, "cpu", -9), stubborn
    by_wall = _run(
        "while True:\n    pass", isolation, HOSTILE.model_copy(update={"cpu_s": 60, "wall_s": 1.5})
    )
    assert (by_wall.ok, by_wall.reason) == (False, "timeout")


def test_closing_its_pipes_does_not_escape_the_wall_limit(isolation: IsolationChoice) -> None:
    limits = HOSTILE.model_copy(update={"wall_s": 1.5})
    result = _run("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)", isolation, limits)
    assert (result.ok, result.reason) == (False, "timeout"), result
    assert limits.wall_s <= result.wall_s < limits.wall_s + 2


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_a_gigabyte_of_output_is_cut_at_the_cap(isolation: IsolationChoice, stream: str) -> None:
    code = f"import sys\nfor _ in range(1 << 14):\n    sys.{stream}.buffer.write(b'x' * (1 << 16))"  # 1 GiB
    result = _run(code, isolation)
    assert (result.ok, result.reason, result.truncated) == (False, "output_limit", True)
    assert len(getattr(result, stream)) == HOSTILE.max_output_bytes


def test_killing_the_parent_fails_and_the_host_survives(isolation: IsolationChoice) -> None:
    result = _run("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", isolation)
    assert (result.ok, result.reason) == (False, "permission"), result.stderr
    escalate = _run("import os\nos.setuid(0)", isolation)
    assert (escalate.ok, escalate.reason) == (False, "permission"), escalate.stderr


def test_kill_minus_one_reaches_no_other_sandbox(isolation: IsolationChoice) -> None:
    """`kill -9 -1` from one sandbox while another runs: the other finishes normally (each run has its
    own uid), and the host test process is still here to check."""
    sleeper_code = "import time\nprint(time.time(), flush=True)\ntime.sleep(3)\nprint(time.time())"
    killer_code = (
        "import os, signal, time\ntime.sleep(1)\nprint(time.time(), flush=True)\n"
        "os.kill(-1, signal.SIGKILL)\nos.system('kill -9 -1')"
    )
    with VerifierPool(concurrency=2, isolation=isolation) as pool:
        sleeper, killer = pool.run_many([sleeper_code, killer_code])
    assert sleeper.ok, sleeper
    started, ended = map(float, sleeper.stdout.split())
    (killed_at,) = map(float, killer.stdout.split())
    assert started < killed_at < ended  # the attack really happened while the other sandbox ran


# Eight children each touch 200 MiB (1,600 MiB in all) under a 256 MiB job limit. Each reports every
# 8 MiB it holds before it tries the next, and keeps it all until it exits.
FORKED_MEMORY = """\
import os, time  # {token}
r, w = os.pipe()
children = []
for _ in range(8):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        held = []
        for _ in range(25):
            held.append(b'x' * (8 << 20))
            os.write(w, b'8 ')
        time.sleep(2)
        os._exit(0)
    children.append(pid)
os.close(w)
statuses = [os.waitpid(pid, 0)[1] for pid in children]
print(sum(map(int, os.read(r, 1 << 16).split())), len(children), statuses)
"""


def test_forked_children_share_one_memory_limit(isolation: IsolationChoice) -> None:
    """The issue's attack: forking to hold 1,336 MiB under a 256 MiB limit. In a job cgroup the kernel
    kills children at the job's limit, the run says "memory", and its measured peak stays under it."""
    _require_job_cgroup()
    token = secrets.token_hex(8)
    result = _run(FORKED_MEMORY.format(token=token), isolation)
    assert result.memory_bound in ("cgroup1", "cgroup2")
    assert (result.ok, result.reason) == (False, "memory"), result
    if result.memory_bound == "cgroup1" or result.memory_peak_mb is not None:  # cgroup2: Linux >= 5.19
        assert result.memory_peak_mb is not None
        assert 200 < result.memory_peak_mb <= HOSTILE.memory_mb  # it pushed up to the limit, not past
    assert _live_processes_running(token) == []
    assert _leftover_job_groups() == []


def test_forked_children_share_one_memory_limit_without_a_cgroup(isolation: IsolationChoice) -> None:
    """The fallback: at most P processes of memory_mb / P address space each, so what the children
    held at once (each reports what it holds; none frees before it exits) stays under the job limit."""
    token = secrets.token_hex(8)
    result = _run(FORKED_MEMORY.format(token=token), isolation, memory_bound="rlimit_split")
    assert result.memory_bound == "rlimit_split" and result.memory_peak_mb is None
    held_mb, children, _ = result.stdout.split(" ", 2)
    assert 0 < int(held_mb) <= HOSTILE.memory_mb, result
    assert int(children) < 8 and "MemoryError" in result.stderr  # forks and allocations were refused
    assert _live_processes_running(token) == []


UNSHARE_USER = """\
import ctypes, os, subprocess
tool = subprocess.run(['unshare', '-U', 'true'], capture_output=True, text=True)
print(tool.returncode, tool.stderr.strip())
if hasattr(os, 'unshare'):  # Python >= 3.12
    os.unshare(os.CLONE_NEWUSER)
elif ctypes.CDLL(None, use_errno=True).unshare(0x10000000) != 0:
    raise PermissionError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
print('created a user namespace')
"""


def test_user_namespaces_cannot_be_created(isolation: IsolationChoice) -> None:
    """A user namespace gives an unprivileged process root's powers over new namespaces and opens
    kernel code otherwise reserved for root; the seccomp filter refuses both routes to one."""
    result = _run(UNSHARE_USER, isolation)
    assert (result.ok, result.reason) == (False, "permission"), result
    assert result.stdout == "1 unshare: unshare failed: Operation not permitted\n"
    assert "Operation not permitted" in result.stderr and "created" not in result.stdout


# Each call's arguments are chosen so that, were it allowed, the kernel would not answer EPERM itself
# (the control run below checks that); the clone child, if one is ever made, exits at once.
SYSCALL_PROBE = """\
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
def call(number, *args):
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(number), *(ctypes.c_long(a) for a in args))
    if result == 0 and number == {clone}:
        os._exit(0)
    if result > 0 and number == {clone}:
        os.waitpid(result, 0)
    return 'ok' if result >= 0 else errno.errorcode[ctypes.get_errno()]
probes = {probes}
print(json.dumps({{name: call(*args) for name, args in probes.items()}}))
"""


def _syscall_probe() -> str:
    column = 0 if platform.machine() == "x86_64" else 1
    number = {name: numbers[column] for name, numbers in DENIED_SYSCALLS.items()}
    clone, clone3 = CLONE_SYSCALLS[platform.machine()]
    probes = {  # unshare last: once it succeeds, the process is in the new namespace
        "clone": (clone, 0x10000000 | 17, 0, 0, 0, 0),  # CLONE_NEWUSER | SIGCHLD
        "clone3": (clone3, 0, 0),  # EINVAL if allowed (no arguments)
        "setns": (number["setns"], -1, 0),
        "ptrace": (number["ptrace"], 16, 0),  # PTRACE_ATTACH to pid 0: ESRCH if allowed
        "process_vm_readv": (number["process_vm_readv"], os.getpid(), 0, 0, 0, 0, 0),
        "pidfd_getfd": (number["pidfd_getfd"], -1, 0, 0),
        "userfaultfd": (number["userfaultfd"], 1),  # UFFD_USER_MODE_ONLY: open to every user
        "keyctl": (number["keyctl"], 9999),  # no such operation
        "io_uring_setup": (number["io_uring_setup"], 1, 0),
        "perf_event_open": (number["perf_event_open"], 0, 0, -1, -1, 0),
        "unshare": (number["unshare"], 0x10000000),  # CLONE_NEWUSER
    }
    return SYSCALL_PROBE.format(clone=clone, probes=probes)


def test_seccomp_refuses_syscalls_code_never_needs(isolation: IsolationChoice) -> None:
    probe = _syscall_probe()
    result = _run(probe, isolation)
    assert result.ok, result
    refused = json.loads(result.stdout)
    assert refused == {name: "ENOSYS" if name == "clone3" else "EPERM" for name in refused}
    # Control: the same calls, unfiltered, from an unprivileged uid as the sandbox uses, get other
    # answers, so the EPERMs above are the filter's.
    python = runner._rlimit_python(as_other_uid=True)
    with runner._lease_uid() as uid:
        ids = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        control = subprocess.run(
            ["setpriv", *ids, "--", python, "-I", "-S", "-c", probe],
            capture_output=True, text=True, cwd="/", timeout=30, check=True,
        )  # fmt: skip
    unfiltered = json.loads(control.stdout)
    assert all(unfiltered[name] != answer for name, answer in refused.items()), unfiltered


def test_ordinary_code_runs_under_the_filter(isolation: IsolationChoice) -> None:
    """Threads (glibc tries clone3 first, then clone), fork, subprocess and a socketpair all work."""
    code = (
        "import os, socket, subprocess, threading\n"
        "threads = [threading.Thread(target=sum, args=[range(10)]) for _ in range(4)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "pid = os.fork()\nif pid == 0:\n    os._exit(7)\n"
        "assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7\n"
        "a, b = socket.socketpair(); a.sendall(b'hi'); assert b.recv(2) == b'hi'\n"
        "print(subprocess.run(['echo', 'ok'], capture_output=True, text=True, check=True).stdout, end='')"
    )
    result = _run(code, isolation)
    assert (result.ok, result.stdout) == (True, "ok\n"), result
