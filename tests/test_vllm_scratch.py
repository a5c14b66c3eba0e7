"""The vLLM engine's scratch directories (weight updates and adapters, in /dev/shm): named after the process
that made them and removed however that process ends: at close(), on a failed start, and, by their watcher
process, when the process exits or is killed (SIGTERM, which uvicorn re-raises after its shutdown, skips
Python's exit cleanup); a directory whose watcher was killed too is swept by the next one. No vLLM needed:
the endings run in plain child processes, and a VllmEngine here fails to start (this environment has no vLLM).

Reference: the QA pass (223 `inflight-vllm-*` directories left in /dev/shm: serve-engine never closed its
engine, and engines killed or restarted never could).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inflight.errors import UserError
from inflight.inference.scratch import ScratchDirectory, sweep_scratch_directories
from inflight.inference.vllm_engine import VllmEngine, VllmEngineConfig

# Makes a scratch directory (with the prefix argv[3], if given), prints it and its watcher's pid, then ends
# as argv[2] says.
CHILD = """
import os, signal, sys
from inflight.inference.scratch import ScratchDirectory
scratch = ScratchDirectory(sys.argv[1], *sys.argv[3:])
print(scratch.path, scratch._watcher.pid, flush=True)
if sys.argv[2] == "watcher-killed-too":
    os.kill(scratch._watcher.pid, signal.SIGKILL)
    scratch._watcher.wait()
    os.kill(os.getpid(), signal.SIGKILL)
elif sys.argv[2] != "exit":
    os.kill(os.getpid(), getattr(signal, sys.argv[2]))
"""


def gone_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def scratch_names(where: Path) -> list[str]:
    return sorted(p.name for p in where.glob("inflight-vllm-*"))


def wait_gone(path: Path, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not path.exists()


def test_a_scratch_directory_is_named_after_its_process_and_gone_after_close(tmp_path: Path) -> None:
    scratch = ScratchDirectory(str(tmp_path))
    assert scratch.path.parent == tmp_path and scratch.path.is_dir()
    assert scratch.path.name.startswith(f"inflight-vllm-{os.getpid()}-")
    (scratch.path / "weights-v1").mkdir()
    scratch.close()
    assert not scratch.path.exists() and scratch._watcher.returncode == 0


def test_the_sweep_removes_only_the_directories_of_processes_that_are_gone(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        kept = [
            f"inflight-vllm-{os.getpid()}-abc_123",  # this process's
            f"inflight-vllm-{sleeper.pid}-x9",  # a live child's
            "inflight-vllm-0pw1zh7g",  # no pid in the name: its process is unknown
            "inflight-vllm-model-k2v",  # not an engine's scratch (the contract test's model copy)
            f"other-{gone_pid()}-x",
        ]
        dead = f"inflight-vllm-{gone_pid()}-q1w2e3"
        for name in [*kept, dead]:
            (tmp_path / name).mkdir()
            (tmp_path / name / "adapter_model.safetensors").write_bytes(b"\0" * 64)
        assert sweep_scratch_directories(tmp_path) == [tmp_path / dead]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize("ending", ["exit", "SIGTERM", "SIGKILL"])
def test_the_directory_goes_however_its_process_ends(ending: str, tmp_path: Path) -> None:
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), ending], capture_output=True, text=True, timeout=120
    )
    made = Path(child.stdout.split()[0])
    assert made.parent == tmp_path, child.stderr
    assert child.returncode == (0 if ending == "exit" else -getattr(signal, ending)), child.stderr
    assert wait_gone(made)


def test_a_directory_of_another_prefix_goes_with_its_process_and_is_swept_only_by_its_own(
    tmp_path: Path,
) -> None:
    """The tests' private Rays keep their temp dirs (~225 KB of session logs) in one of these, prefix
    `inflight-ray`: made with `mkdtemp(prefix="ray-")`, they stayed in /tmp whenever the process was killed
    (tests/test_launch_ray.py). A sweep removes dead processes' directories of its own prefix only."""
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), "SIGKILL", "inflight-ray"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    made = Path(child.stdout.split()[0])
    assert made.parent == tmp_path and made.name.startswith("inflight-ray-"), child.stderr
    assert wait_gone(made)
    ray_dir, vllm_dir = (tmp_path / f"inflight-{kind}-{gone_pid()}-x1" for kind in ("ray", "vllm"))
    ray_dir.mkdir()
    vllm_dir.mkdir()
    assert sweep_scratch_directories(tmp_path, "inflight-ray") == [ray_dir]
    assert vllm_dir.is_dir()


def test_a_directory_whose_watcher_was_killed_too_is_swept_by_the_next(tmp_path: Path) -> None:
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), "watcher-killed-too"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    made = Path(child.stdout.split()[0])
    assert made.is_dir(), child.stderr
    successor = ScratchDirectory(str(tmp_path))
    assert scratch_names(tmp_path) == [successor.path.name]
    successor.close()


def test_an_engine_that_fails_to_start_leaves_no_scratch_directory(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(UserError, match="needs vLLM"):
        VllmEngine(str(tiny_model_dir), VllmEngineConfig(scratch_dir=str(tmp_path)))
    assert scratch_names(tmp_path) == []
