"""Hostile code in the sandbox: each attack from issue 5 is contained, reported as a failed run with its
reason, and the sandbox still works afterwards (checked after every test).

References: bubblewrap(1); setrlimit(2) and kill(2) (`kill(-1)` reaches every process the caller may
signal: its own uid's); proc(5) (/proc/PID/environ needs ptrace access). rlimit mode has no network or
filesystem isolation by design, so the network test and the private-/tmp checks are bwrap-only.
"""

from __future__ import annotations

import ast
import os
import secrets
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from inflight.envs.sandbox import IsolationChoice, SandboxLimits, SandboxResult, bwrap_problem, run_python
from inflight.envs.sandbox.pool import VerifierPool

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


def _run(code: str, isolation: IsolationChoice, limits: SandboxLimits = HOSTILE) -> SandboxResult:
    return run_python(code, limits=limits, isolation=isolation)


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


def test_fork_bomb_is_contained(isolation: IsolationChoice) -> None:
    token = secrets.token_hex(8)
    result = _run(f"import os  # {token}\nwhile True:\n    os.fork()", isolation)
    assert (result.ok, result.reason) == (False, "processes"), result.stderr
    assert _live_processes_running(token) == []  # every copy is gone, not just the first


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
    by_cpu = _run("while True:\n    pass", isolation, HOSTILE.model_copy(update={"cpu_s": 1, "wall_s": 60}))
    assert (by_cpu.ok, by_cpu.reason) == (False, "cpu")
    by_wall = _run(
        "while True:\n    pass", isolation, HOSTILE.model_copy(update={"cpu_s": 60, "wall_s": 1.5})
    )
    assert (by_wall.ok, by_wall.reason) == (False, "timeout")


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
