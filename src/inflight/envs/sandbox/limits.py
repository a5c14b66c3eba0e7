"""Resource limits of one sandboxed execution, with units in the names.

Owns the numbers and their validation; knows nothing of how they are enforced (see `command.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# "auto" takes bwrap where it works here and falls back to rlimit with a warning.
IsolationChoice = Literal["auto", "bwrap", "rlimit"]
Isolation = Literal["bwrap", "rlimit"]
# How a job's memory is bounded as a whole (see memory_bound.py); "auto" takes a cgroup where one can be
# made here and falls back to rlimit_split.
MemoryBoundChoice = Literal["auto", "cgroup", "rlimit_split"]
MemoryBound = Literal["cgroup2", "cgroup1", "rlimit_split"]


class SandboxLimits(BaseModel):
    """What one execution may use. The defaults suit a unit test of a small function."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu_s: int = Field(default=5, ge=1, le=3600)  # RLIMIT_CPU per process: SIGXCPU, SIGKILL 1 s later
    wall_s: float = Field(default=10.0, gt=0, le=3600)  # the whole process tree is killed after this
    # The whole job: all its processes together (a cgroup), and each one's RLIMIT_AS. Without a cgroup,
    # each process gets a share of it (memory_bound.py).
    memory_mb: int = Field(default=512, ge=32, le=1 << 20)
    max_processes: int = Field(default=32, ge=1, le=4096)  # tasks (threads count): pids cgroup and NPROC
    max_output_bytes: int = Field(default=1 << 20, ge=1, le=1 << 30)  # per stream; killed on overflow
    max_file_mb: int = Field(default=16, ge=0, le=1 << 20)  # RLIMIT_FSIZE: largest file it may write
    tmpfs_mb: int = Field(default=64, ge=1, le=1 << 20)  # bwrap: size of the private /tmp (all files)
    # One argv string is at most 128 KiB on Linux (MAX_ARG_STRLEN); the code travels as `python -c`.
    max_code_bytes: int = Field(default=100_000, ge=1, le=120_000)


def merge_limits(base: SandboxLimits, overrides: SandboxLimits | Mapping[str, Any] | None) -> SandboxLimits:
    """Limits from a caller: an instance as is, a mapping's keys over `base` (validated), None as `base`."""
    if overrides is None or isinstance(overrides, SandboxLimits):
        return overrides or base
    return SandboxLimits.model_validate(base.model_dump() | dict(overrides))


def within_time(limits: SandboxLimits, timeout_s: float | None) -> SandboxLimits:
    """`limits` with `wall_s` cut to `timeout_s` (> 0) when that is shorter: a step told how long its episode
    has left (OpenEnv's `step(action, timeout_s)`) runs no execution past it. As they are without one."""
    if timeout_s is None or timeout_s >= limits.wall_s:
        return limits
    return limits.model_copy(update={"wall_s": timeout_s})
