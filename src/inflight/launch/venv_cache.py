"""A virtual environment built once and reused: built beside its final place and renamed into it only when
every step succeeded, so an interrupted build is never mistaken for a cached one; `run_step` runs one step of
a build. Used for the vLLM environment (`vllm_env.py`), TRL's (`inflight bench trl`) and the tests'
environments of older `tinker` SDKs. Knows nothing of what goes in.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path


class VenvBuildError(RuntimeError):
    """A step of building an environment failed; the message says which and pip's own error lines."""


def run_step(what: str, *command: str, timeout_s: float) -> None:
    """Run one build step (a venv, a pip install); VenvBuildError naming `what` and pip's ERROR lines (else
    its last lines) when it fails or runs past `timeout_s`."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise VenvBuildError(f"{what}: no result after {timeout_s} s") from None
    if done.returncode != 0:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")] or lines[-20:]
        raise VenvBuildError(f"{what} failed (exit code {done.returncode}): " + "; ".join(errors))


def cached_venv(env: Path, build: Callable[[Path], None]) -> Path:
    """The interpreter of the environment at `env`; when it does not exist yet, `build(directory)` fills a
    fresh directory (creating the venv itself), which then becomes `env`. `build` raises to give up."""
    python = env / "bin" / "python"
    if python.exists():
        return python
    env.parent.mkdir(parents=True, exist_ok=True)
    building = env.with_name(f"{env.name}.building-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    try:
        build(building)
        with contextlib.suppress(OSError):  # another run finished the same environment first: use theirs
            building.rename(env)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return python
