"""The code sandbox: run untrusted Python in a fresh, limited process, one at a time or from a pool.

    result = run_python("print(sum(range(10)))", limits=SandboxLimits(wall_s=2))
    result.ok, result.reason, result.stdout, result.isolation  # True, None, "45\n", "bwrap"
    result.memory_bound  # "cgroup1": memory_mb bounds the job's processes together

Isolation is bubblewrap (namespaces: no network, only a private /tmp writable, host files hidden)
where it works, else rlimits only, which the result's `warning` and the log say plainly. In both, a
seccomp filter refuses namespaces, mounts, ptrace and other syscalls code under test never needs
(seccomp.py), and the job's memory is bounded as a whole: by a cgroup where one can be made, else by
a process cap times a per-process share (memory_bound.py).
"""

from inflight.envs.sandbox.limits import (
    Isolation,
    IsolationChoice,
    MemoryBound,
    MemoryBoundChoice,
    SandboxLimits,
    merge_limits,
    within_time,
)
from inflight.envs.sandbox.memory_bound import detect_memory_bound, resolve_memory_bound
from inflight.envs.sandbox.pool import (
    Verifier,
    VerifierPool,
    VerifierPoolConfig,
    default_pool,
    set_default_pool,
)
from inflight.envs.sandbox.result import RLIMIT_WARNING, Reason, SandboxResult, classify
from inflight.envs.sandbox.runner import bwrap_problem, detect_isolation, resolve_isolation, run_python

__all__ = [
    "RLIMIT_WARNING",
    "Isolation",
    "IsolationChoice",
    "MemoryBound",
    "MemoryBoundChoice",
    "Reason",
    "SandboxLimits",
    "SandboxResult",
    "Verifier",
    "VerifierPool",
    "VerifierPoolConfig",
    "bwrap_problem",
    "classify",
    "default_pool",
    "detect_isolation",
    "detect_memory_bound",
    "merge_limits",
    "resolve_isolation",
    "resolve_memory_bound",
    "run_python",
    "set_default_pool",
    "within_time",
]
