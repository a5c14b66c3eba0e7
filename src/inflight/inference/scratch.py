"""The vLLM engine's scratch directory (weight and adapter files for vLLM to read), removed however the
process that made it ends: `VllmEngine` runs in `serve-engine`'s process, which a restart SIGKILLs and whose
uvicorn re-raises SIGTERM after its shutdown, skipping Python's exit cleanup. Any other directory that must
not outlive its process takes a prefix of its own (the tests' private Rays: `inflight-ray`)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# A ScratchDirectory's name, PREFIX-PID-RANDOM, carries the pid of the process that made it (serve-engine's,
# where vLLM runs, for the default prefix).
VLLM_PREFIX = "inflight-vllm"
_REMOVE_AT_EOF = "import shutil, sys; sys.stdin.buffer.read(); shutil.rmtree(sys.argv[1], ignore_errors=True)"


class ScratchDirectory:
    """A fresh directory of this process's for weight and adapter files, in `parent` (default: /dev/shm where
    it exists, else the temp dir), removed however this process ends. A watcher process removes it once the
    pipe only this process writes to closes: at close(), or when this process is gone, also by a signal
    that skips Python's exit cleanup (uvicorn re-raises SIGTERM after its shutdown; a restart SIGKILLs).
    Were the watcher killed too, the next one made in `parent` sweeps it: the name carries this pid."""

    def __init__(self, parent: str | None = None, prefix: str = VLLM_PREFIX) -> None:
        shm = Path("/dev/shm")
        where = Path(parent) if parent else shm if shm.is_dir() else Path(tempfile.gettempdir())
        sweep_scratch_directories(where, prefix)
        self.path = Path(tempfile.mkdtemp(prefix=f"{prefix}-{os.getpid()}-", dir=where))
        self._watcher = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _REMOVE_AT_EOF, str(self.path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # out of this process's group: a signal to the group spares it
        )

    def close(self) -> None:
        """Remove the directory now (the watcher does, and exits)."""
        assert self._watcher.stdin is not None
        self._watcher.stdin.close()
        self._watcher.wait()


def sweep_scratch_directories(where: Path, prefix: str = VLLM_PREFIX) -> list[Path]:
    """Remove the scratch directories named with `prefix` in `where` whose process is gone; return them.
    Names without a pid (made before names carried one) are left alone: nothing tells whether their process
    still runs."""
    name = re.compile(rf"{re.escape(prefix)}-(\d+)-[a-z0-9_]+")
    removed = []
    for path in where.glob(f"{prefix}-*"):
        match = name.fullmatch(path.name)
        if match and not _process_exists(int(match[1])):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
