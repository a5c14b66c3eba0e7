"""How one job's memory is bounded as a whole, however many processes it starts.

Owns the choice and the per-process numbers each choice implies; the cgroup mechanics live in
`cgroup.py`. In order of preference:

- "cgroup2" / "cgroup1": the job runs in its own cgroup, whose memory limit (memory_mb, swap included
  where swap is accounted) covers all its processes, their page cache and their /tmp files, and whose
  pids limit caps its tasks. A process the kernel kills there for memory makes the run "memory". Needs
  root, or a cgroup2 subtree delegated to us with memory and pids enabled for children.
- "rlimit_split": no cgroup can be made here. The job may have at most P tasks (RLIMIT_NPROC) of at
  most memory_mb / P address space each (RLIMIT_AS), so together they stay under memory_mb. P is
  max_processes, lowered so that each process keeps SPLIT_MIN_PROCESS_MB (Python itself needs ~12 MiB).
  RLIMIT_NPROC counts per real uid and exempts root, so the bound is exact only under the runner's
  throwaway uid (running as root); as another user it also counts that user's own processes.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from inflight.envs.sandbox.cgroup import CgroupLayout, cgroup_layout
from inflight.envs.sandbox.limits import Isolation, MemoryBound, MemoryBoundChoice, SandboxLimits
from inflight.errors import UserError

log = logging.getLogger(__name__)

SPLIT_MIN_PROCESS_MB = 64
# Tasks in a bwrap job's cgroup besides the sandboxed code: bwrap itself and its pid-namespace init.
BWRAP_TASKS = 2


@dataclass(frozen=True)
class ProcessBudget:
    max_tasks: int  # RLIMIT_NPROC of the sandboxed code
    address_space_mb: int  # RLIMIT_AS of each of its processes


def process_budget(limits: SandboxLimits, bound: MemoryBound) -> ProcessBudget:
    """The per-process limits that, with `bound`, keep the whole job under limits.memory_mb."""
    if bound != "rlimit_split":  # the cgroup bounds the sum; each process may use all of it
        return ProcessBudget(limits.max_processes, limits.memory_mb)
    tasks = max(1, min(limits.max_processes, limits.memory_mb // SPLIT_MIN_PROCESS_MB))
    return ProcessBudget(tasks, limits.memory_mb // tasks)


def cgroup_tasks(limits: SandboxLimits, isolation: Isolation) -> int:
    """The job cgroup's pids limit: the code's tasks plus the sandbox's own."""
    return limits.max_processes + (BWRAP_TASKS if isolation == "bwrap" else 0)


@functools.cache
def detect_memory_bound() -> MemoryBound:
    """What "auto" picks here: a job cgroup where one can be made (probed once), else rlimit_split."""
    layout = cgroup_layout()
    if isinstance(layout, str):
        log.warning(
            "no job cgroup can be made here (%s); the sandbox splits memory_mb over a process cap instead",
            layout,
        )
        return "rlimit_split"
    return layout.version


def resolve_memory_bound(choice: MemoryBoundChoice) -> MemoryBound:
    if choice == "auto":
        return detect_memory_bound()
    if choice == "cgroup":
        layout = cgroup_layout()
        if isinstance(layout, str):
            raise UserError(f"memory_bound='cgroup' was asked for, but no job cgroup can be made: {layout}")
        return layout.version
    if choice == "rlimit_split":
        return "rlimit_split"
    raise UserError(f"unknown memory_bound {choice!r}; use 'auto', 'cgroup' or 'rlimit_split'")


def job_layout(bound: MemoryBound) -> CgroupLayout | None:
    """The cgroup layout a job with `bound` runs in; None for rlimit_split."""
    if bound == "rlimit_split":
        return None
    layout = cgroup_layout()
    assert not isinstance(layout, str), "resolve_memory_bound() checked that a cgroup can be made"
    return layout
