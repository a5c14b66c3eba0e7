"""The code sandbox: running code, limits, results and reasons, in both isolation modes.

References: bubblewrap(1) (namespaces, --die-with-parent, --size/--tmpfs, --seccomp), setrlimit(2)
(RLIMIT_CPU sends SIGXCPU at the soft limit; RLIMIT_AS, RLIMIT_NPROC, RLIMIT_FSIZE), seccomp(2) and the
kernel's syscall tables (arch/x86/entry/syscalls/syscall_64.tbl, include/uapi/asm-generic/unistd.h),
and Python's own error messages for what each limit looks like from inside. Hostile code lives in
test_sandbox_security.py.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
from pathlib import Path
from typing import cast

import pytest
from pydantic import ValidationError

from inflight.envs.sandbox import (
    RLIMIT_WARNING,
    IsolationChoice,
    SandboxLimits,
    bwrap_problem,
    classify,
    detect_isolation,
    detect_memory_bound,
    resolve_isolation,
    run_python,
    runner,
)
from inflight.envs.sandbox.memory_bound import SPLIT_MIN_PROCESS_MB, process_budget
from inflight.envs.sandbox.seccomp import (
    AUDIT_ARCH,
    CLONE_SYSCALLS,
    DENIED_SYSCALLS,
    RET_ALLOW,
    filter_program,
)
from inflight.errors import UserError

QUICK = SandboxLimits(wall_s=20, cpu_s=10)


@pytest.fixture(params=["bwrap", "rlimit"])
def isolation(request: pytest.FixtureRequest) -> IsolationChoice:
    """Both modes; bwrap must work in CI (it installs bubblewrap and runs as root)."""
    if request.param == "bwrap" and (problem := bwrap_problem()):
        if os.environ.get("CI"):
            pytest.fail(f"bubblewrap must work in CI: {problem}")
        pytest.skip(f"bubblewrap does not work here: {problem}")
    if request.param == "rlimit" and os.geteuid() != 0:
        # Without root there is no throwaway uid, and the code would run as the test runner itself.
        if os.environ.get("CI"):
            pytest.fail("CI must run the sandbox tests as root (rlimit mode needs a throwaway uid)")
        pytest.skip("rlimit-mode tests need root")
    return cast(IsolationChoice, request.param)


def test_auto_isolation_is_bwrap_where_it_works() -> None:
    assert detect_isolation() == ("bwrap" if bwrap_problem() is None else "rlimit")
    assert resolve_isolation("auto") == detect_isolation()
    if os.environ.get("CI"):
        assert detect_isolation() == "bwrap", bwrap_problem()


def test_runs_code_and_says_how_it_was_isolated(isolation: IsolationChoice) -> None:
    result = run_python("print(sum(range(10)))", limits=QUICK, isolation=isolation)
    assert (result.ok, result.exit_code, result.reason, result.stdout) == (True, 0, None, "45\n")
    assert result.isolation == isolation and not result.truncated
    if isolation == "rlimit":
        assert result.warning == RLIMIT_WARNING and "no network or filesystem isolation" in result.warning
    else:
        assert result.warning is None


def test_rlimit_mode_says_so_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    runner._warn_rlimit_once.cache_clear()  # the warning is logged once per process
    with caplog.at_level(logging.WARNING, logger="inflight.envs.sandbox.runner"):
        resolve_isolation("rlimit")
    assert any("no network or filesystem isolation" in r.getMessage() for r in caplog.records)


def test_unknown_isolation_is_a_clear_error() -> None:
    with pytest.raises(UserError, match="unknown sandbox isolation 'docker'"):
        run_python("pass", isolation="docker")  # type: ignore[arg-type]
    with pytest.raises(UserError, match="unknown memory_bound 'ulimit'"):
        run_python("pass", memory_bound="ulimit")  # type: ignore[arg-type]


def test_each_result_says_how_the_jobs_memory_was_bounded(isolation: IsolationChoice) -> None:
    result = run_python("print(1)", limits=QUICK, isolation=isolation)
    assert result.ok and result.memory_bound == detect_memory_bound()
    if os.environ.get("CI"):  # CI runs as root on machines with a cgroup v1 memory hierarchy
        assert result.memory_bound != "rlimit_split"
    split = run_python("print(1)", limits=QUICK, isolation=isolation, memory_bound="rlimit_split")
    assert split.ok and (split.memory_bound, split.memory_peak_mb) == ("rlimit_split", None)


@pytest.mark.parametrize("memory_mb", [32, 63, 64, 256, 512, 1000, 4096])
@pytest.mark.parametrize("max_processes", [1, 3, 16, 32, 4096])
def test_without_a_cgroup_processes_times_their_share_stay_under_the_job_limit(
    memory_mb: int, max_processes: int
) -> None:
    limits = SandboxLimits(memory_mb=memory_mb, max_processes=max_processes)
    split = process_budget(limits, "rlimit_split")
    assert 1 <= split.max_tasks <= max_processes
    assert split.max_tasks * split.address_space_mb <= memory_mb
    assert split.address_space_mb >= min(memory_mb, SPLIT_MIN_PROCESS_MB)  # room for Python to start
    whole = process_budget(limits, "cgroup1")  # the cgroup bounds the sum: each process may use it all
    assert (whole.max_tasks, whole.address_space_mb) == (max_processes, memory_mb)


def test_limits_are_validated_with_their_names() -> None:
    with pytest.raises(ValidationError, match="memory_mb"):
        SandboxLimits(memory_mb=1)
    with pytest.raises(ValidationError, match="wall_s"):
        SandboxLimits(wall_s=0)


def test_stdin_reaches_the_code_whole(isolation: IsolationChoice) -> None:
    data = "".join(chr(32 + i % 90) for i in range(1 << 20))  # 1 MiB: more than a pipe buffer holds
    code = "import sys, hashlib; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())"
    result = run_python(code, stdin=data, limits=QUICK, isolation=isolation)
    assert result.ok and result.stdout.strip() == hashlib.sha256(data.encode()).hexdigest()
    # Code that never reads its stdin must not make the runner block on writing it.
    unread = run_python("print('done')", stdin=data, limits=QUICK, isolation=isolation)
    assert unread.ok and unread.stdout == "done\n"


def test_failures_carry_exit_code_reason_and_traceback(isolation: IsolationChoice) -> None:
    exited = run_python("import sys; sys.exit(3)", limits=QUICK, isolation=isolation)
    assert (exited.ok, exited.exit_code, exited.reason) == (False, 3, "error")
    raised = run_python("raise ValueError('bad value')", limits=QUICK, isolation=isolation)
    assert (raised.ok, raised.exit_code, raised.reason) == (False, 1, "error")
    assert "ValueError: bad value" in raised.stderr
    code = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
    signalled = run_python(code, limits=QUICK, isolation=isolation)
    assert (signalled.exit_code, signalled.reason) == (-15, "killed")


def test_each_run_starts_with_an_empty_private_directory(isolation: IsolationChoice) -> None:
    write = "import os; open('left_behind', 'w').write('x'); print(os.getcwd() == os.environ['HOME'])"
    first = run_python(write, limits=QUICK, isolation=isolation)
    assert first.ok and first.stdout == "True\n"
    second = run_python("import os; print(os.listdir('.'))", limits=QUICK, isolation=isolation)
    assert second.ok and second.stdout == "[]\n"


def test_only_the_standard_library_is_importable(isolation: IsolationChoice) -> None:
    # The project's virtualenv (pydantic, torch, ...) stays out of the sandbox.
    result = run_python("import json, pydantic", limits=QUICK, isolation=isolation)
    assert not result.ok and "No module named 'pydantic'" in result.stderr


@pytest.mark.parametrize(
    ("code", "limits", "reason"),
    [
        ("while True: pass", SandboxLimits(cpu_s=1, wall_s=30), "cpu"),
        ("import time; time.sleep(60)", SandboxLimits(wall_s=1), "timeout"),
        ("x = bytearray(1 << 30)", SandboxLimits(memory_mb=256), "memory"),
        ("open('big', 'wb').write(bytes(2 << 20))", SandboxLimits(max_file_mb=1), "disk_limit"),
        (
            "import threading, time\n"
            "for _ in range(64):\n    threading.Thread(target=time.sleep, args=[5]).start()",
            SandboxLimits(max_processes=8),
            "processes",
        ),
    ],
    ids=["cpu", "wall", "memory", "file_size", "threads"],
)
def test_each_limit_stops_the_code_and_names_itself(
    isolation: IsolationChoice, code: str, limits: SandboxLimits, reason: str
) -> None:
    result = run_python(code, limits=limits, isolation=isolation)
    assert (result.ok, result.reason) == (False, reason), result.stderr
    if reason == "timeout":
        assert result.wall_s >= limits.wall_s  # it ran until the deadline, then the tree was killed


def test_private_tmp_has_a_size_limit() -> None:
    if bwrap_problem():
        pytest.skip("the tmpfs size limit exists in bwrap mode only")
    code = "for i in range(8):\n    open(f'/tmp/f{i}', 'wb').write(bytes(1 << 20))"
    result = run_python(code, limits=SandboxLimits(tmpfs_mb=4, max_file_mb=2), isolation="bwrap")
    assert (result.ok, result.reason) == (False, "disk_limit") and "No space left" in result.stderr


def test_output_up_to_the_cap_is_kept_whole_and_beyond_it_is_cut(isolation: IsolationChoice) -> None:
    limits = SandboxLimits(max_output_bytes=1000, wall_s=20)
    exact = run_python("print('x' * 999)", limits=limits, isolation=isolation)
    assert exact.ok and not exact.truncated and len(exact.stdout) == 1000
    over = run_python("import sys; sys.stderr.write('e' * 5000)", limits=limits, isolation=isolation)
    assert (over.ok, over.reason, over.truncated, over.stderr) == (False, "output_limit", True, "e" * 1000)


def test_undecodable_output_is_replaced_not_fatal(isolation: IsolationChoice) -> None:
    code = "import sys; sys.stdout.buffer.write(b'ok \\xff\\xfe')"
    result = run_python(code, limits=QUICK, isolation=isolation)
    assert result.ok and result.stdout == "ok \ufffd\ufffd"


def test_code_that_cannot_run_is_reported_without_running() -> None:
    small = SandboxLimits(max_code_bytes=100)
    too_large = run_python("x = 1\n" * 100, limits=small)
    assert (too_large.ok, too_large.reason, too_large.exit_code) == (False, "code_too_large", None)
    assert "max_code_bytes=100" in too_large.stderr
    nul = run_python("print(1)\0")
    assert (nul.ok, nul.reason) == (False, "error") and "null bytes" in nul.stderr
    surrogate = run_python("print('\ud800')")
    assert (surrogate.ok, surrogate.reason) == (False, "error") and "not valid text" in surrogate.stderr


@pytest.mark.parametrize(
    ("exit_code", "last_line", "reason"),
    [
        (0, "", None),
        (1, "MemoryError", "memory"),
        (1, "BlockingIOError: [Errno 11] Resource temporarily unavailable", "processes"),
        (1, "RuntimeError: can't start new thread", "processes"),
        (1, "OSError: [Errno 101] Network is unreachable", "network"),
        (1, "socket.gaierror: [Errno -3] Temporary failure in name resolution", "network"),
        (1, "ConnectionRefusedError: [Errno 111] Connection refused", "network"),
        (1, "OSError: [Errno 30] Read-only file system: '/usr/x'", "filesystem"),
        (1, "PermissionError: [Errno 13] Permission denied: '/etc/x'", "filesystem"),
        (1, "PermissionError: [Errno 1] Operation not permitted", "permission"),
        (1, "OSError: [Errno 27] File too large", "disk_limit"),
        (1, "OSError: [Errno 28] No space left on device", "disk_limit"),
        (1, "AssertionError", "error"),
        (2, "", "error"),
        (-24, "", "cpu"),
        (-9, "", "killed"),
    ],
)
def test_classify_reads_the_reason_from_exit_code_and_traceback(
    exit_code: int, last_line: str, reason: str | None
) -> None:
    stderr = (
        f'Traceback (most recent call last):\n  File "<string>", line 1\n{last_line}\n' if last_line else ""
    )
    assert classify(exit_code, stderr) == reason


def test_classify_reads_interleaved_tracebacks_of_forked_children() -> None:
    # A fork bomb's children share its stderr: the text may end inside another child's traceback.
    refused = "BlockingIOError: [Errno 11] Resource temporarily unavailable"
    header, frame = "Traceback (most recent call last):", '  File "<string>", line 3, in <module>'
    stderr = "\n".join([header, header, frame, refused, header, frame, refused, header, frame]) + "\n"
    assert classify(1, stderr) == "processes"
    assert classify(1, f"{header}\n{frame}\n") == "error"  # no exception line at all


def test_a_kill_by_the_runner_outranks_the_traceback() -> None:
    assert classify(1, "MemoryError\n", killed_for="output_limit") == "output_limit"


def test_what_the_job_cgroup_saw_decides_memory_and_cpu_kills() -> None:
    # Any process of the job killed at the job's memory limit makes the run "memory", even if the
    # parent then exits 0; only the runner's own kill outranks it.
    assert classify(0, "", oom_killed=True) == "memory"
    assert classify(-9, "", oom_killed=True) == "memory"
    assert classify(-9, "", killed_for="timeout", oom_killed=True) == "timeout"
    # SIGKILL is the hard CPU limit when the job used its CPU time; otherwise someone else's kill.
    assert classify(-9, "", cpu_limit_reached=True) == "cpu"
    assert classify(-9, "") == "killed"
    assert classify(1, "ValueError: x\n", cpu_limit_reached=True) == "error"


@pytest.mark.parametrize("machine", sorted(AUDIT_ARCH))
def test_seccomp_program_is_well_formed(machine: str) -> None:
    program = filter_program(machine)
    instructions = [struct.unpack("<HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    assert len(program) % 8 == 0 and len(instructions) < 4096  # BPF_MAXINSNS
    for index, (code, jump_true, jump_false, _) in enumerate(instructions):
        if code & 0x07 == 0x05:  # BPF_JMP: both targets inside the program
            assert index + 1 + max(jump_true, jump_false) < len(instructions)
    assert instructions[0] == (0x20, 0, 0, 4)  # it checks the architecture first
    assert instructions[1][3] == AUDIT_ARCH[machine]
    assert sum(code == 0x06 and k == RET_ALLOW for code, _, _, k in instructions) == 2


# Kernel headers for the syscall numbers, where the linux-libc-dev package put them.
SYSCALL_HEADERS = {
    "x86_64": Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
    "aarch64": Path("/usr/include/asm-generic/unistd.h"),
}


@pytest.mark.parametrize("machine", sorted(SYSCALL_HEADERS))
def test_seccomp_syscall_numbers_match_the_kernel_headers(machine: str) -> None:
    header = SYSCALL_HEADERS[machine]
    if not header.exists():
        pytest.skip(f"{header} is not installed (linux-libc-dev)")
    defined = {
        name: int(number)
        for name, number in re.findall(r"#define __NR(?:3264)?_(\w+)\s+(\d+)", header.read_text())
    }
    column = 0 if machine == "x86_64" else 1
    expected = {name: numbers[column] for name, numbers in DENIED_SYSCALLS.items()}
    expected |= dict(zip(("clone", "clone3"), CLONE_SYSCALLS[machine], strict=True))
    assert {name: defined.get(name) for name in expected} == expected
