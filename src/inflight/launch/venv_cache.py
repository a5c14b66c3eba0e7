"""A virtual environment built once and reused: built beside its final place and renamed into it only when
every step succeeded, so an interrupted build is never mistaken for a cached one. Used for the vLLM
environment (`vllm_env.py`) and the tests' environments of older `tinker` SDKs. Knows nothing of what goes in.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path


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
