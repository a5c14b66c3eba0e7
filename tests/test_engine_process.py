"""`launch/engine_process.py`: a `serve-engine` process that is restarted on its port when it dies, and
that never outlives the process that started it (issue 13 item 5, "an engine replica that dies is replaced
and the run continues"). The built-in backend stands in for vLLM here: the supervision is the same for
both, and it starts in seconds (the vLLM runs are in test_launch_vllm.py and test_launch_ray.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from inflight.errors import UserError
from inflight.launch.engine_process import EngineProcess

pytestmark = pytest.mark.slow


def wait_for(condition, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie (dead, not yet reaped by its new parent) counts as gone.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def builtin_engine(model_dir: Path, max_restarts: int = 0) -> EngineProcess:
    return EngineProcess(model_dir, backend="builtin", max_batch_size=4, threads=1, max_restarts=max_restarts)


def test_a_dead_engine_process_is_restarted_on_its_port_until_the_limit(tiny_model_dir: Path) -> None:
    with builtin_engine(tiny_model_dir, max_restarts=1) as server:
        first, url = server.pid, server.url
        assert first is not None and httpx.get(f"{url}/health").status_code == 200
        os.kill(first, signal.SIGKILL)  # a crash, not a polite exit
        wait_for(lambda: server.restarts == 1 and server.pid != first, 30, "the restart")
        wait_for(lambda: _healthy(url), 60, "the restarted engine's /health")
        assert server.url == url and server.alive()
        # The one restart allowed is spent: the next death is final, and said so.
        second = server.pid
        assert second is not None
        os.kill(second, signal.SIGKILL)
        wait_for(lambda: not server.alive(), 10, "the second death")
        time.sleep(1.5)  # three supervision intervals: nothing starts again
        assert server.restarts == 1 and server.pid == second and not _healthy(url)
    assert not server.alive()


def test_calls_made_while_the_only_engine_restarts_wait_for_it(tiny_model_dir: Path) -> None:
    """The pipeline's client (`BalancedClient`, under HttpEngine) waits out a restart of its only replica
    (ClientConfig.outage_wait_s) instead of failing the calls made meanwhile: the call that finds it dead
    is retried on the restarted process."""
    from inflight.inference.client import ClientConfig
    from inflight.inference.http_engine import HttpEngine
    from inflight.types import SampleRequest, SamplingParams

    requests = [SampleRequest([5, 6, 7], SamplingParams(max_tokens=200, seed=i)) for i in range(4)]
    with (
        builtin_engine(tiny_model_dir, max_restarts=1) as server,
        HttpEngine([server.url], ClientConfig(outage_wait_s=60, health_interval_s=0.2)) as engine,
    ):
        expected = engine.generate(requests)
        pid = server.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        again = engine.generate(requests)  # the client still believes the replica up: it fails, then waits
        assert server.restarts == 1 and server.pid != pid
        metrics = engine.metrics()
    assert metrics.replica_failures >= 1 and metrics.recoveries >= 1, metrics
    # Seeded: the restarted engine (the same weights, from disk) gives the same tokens.
    assert [c.token_ids for c in again] == [c.token_ids for c in expected]


def test_stop_ends_supervision_and_a_failed_start_is_one_message(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    server = builtin_engine(tiny_model_dir, max_restarts=-1)
    with server:
        pid = server.pid
    assert pid is not None and gone(pid)
    time.sleep(1.5)
    assert server.pid is None and server.restarts == 0  # stopping is not a death to repair
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    with pytest.raises(UserError, match=r"serve-engine --backend builtin .* exited with code \d+; its log"):
        EngineProcess(not_a_model, backend="builtin", max_restarts=3).start()


def test_the_engine_process_stops_when_its_launcher_dies(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A launcher killed outright (no cleanup runs) leaves no engine behind: serve-engine --parent-pid."""
    pid_file = tmp_path / "engine.pid"
    launcher = subprocess.Popen(
        [
            sys.executable, "-c",
            "import sys, time; from inflight.launch.engine_process import EngineProcess\n"
            f"server = EngineProcess({str(tiny_model_dir)!r}, backend='builtin', threads=1)\n"
            f"server.start(); open({str(pid_file)!r}, 'w').write(str(server.pid)); time.sleep(600)",
        ],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")},
    )  # fmt: skip
    try:
        wait_for(lambda: pid_file.exists() and pid_file.read_text(), 120, "the engine to serve")
        engine_pid = int(pid_file.read_text())
        assert not gone(engine_pid)
        launcher.kill()
        launcher.wait(10)
        wait_for(lambda: gone(engine_pid), 20, "the orphaned engine to stop")
    finally:
        launcher.kill()
        if pid_file.exists() and pid_file.read_text() and not gone(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
