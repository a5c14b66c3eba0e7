"""A virtual environment built once and reused: built beside its final place and renamed into it only when
every step succeeded, so an interrupted build is never mistaken for a cached one; `run_step` runs one step of
a build. Used for the vLLM environment (`vllm_env.py`), TRL's (`inflight bench trl`) and the tests'
environments of older `tinker` SDKs. Knows nothing of what goes in.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path


class VenvBuildError(RuntimeError):
    """A step of building an environment failed; the message says which and pip's own error lines."""


class VenvLocationError(VenvBuildError):
    """The environment's place cannot hold one (something not a directory in the way, a directory that
    cannot be made, one that holds other files): checked before anything is built, and raised too if the
    built environment still cannot be moved there. The message says which path and why; the caller, which
    knows what named the place, says how to name another."""


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
    building = env.with_name(f"{env.name}.building-{os.getpid()}")
    _prepare(env, building)  # a place that cannot hold the environment fails here, not after a long build
    try:
        build(building)
        try:
            building.rename(env)
        except OSError as e:
            if not python.exists():  # else another run finished the same environment first: use theirs
                raise VenvLocationError(f"cannot move the built environment to {env}: {e.strerror}") from None
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return python


def _prepare(env: Path, building: Path) -> None:
    """Make `env`'s parent and an empty `building` directory beside it (`python -m venv` fills an empty
    one); VenvLocationError when `env` cannot become the environment."""
    for path in (env, *env.parents):  # the nearest that exists must be a directory
        if path.exists():
            if not path.is_dir():
                raise VenvLocationError(f"{path} is not a directory")
            break
    if env.is_dir() and any(env.iterdir()):  # the finished environment could not be renamed onto it
        raise VenvLocationError(f"{env} is a directory that holds other files (no bin/python)")
    try:
        env.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(building, ignore_errors=True)
        building.mkdir()
    except OSError as e:
        raise VenvLocationError(f"cannot create {e.filename or building}: {e.strerror}") from None
