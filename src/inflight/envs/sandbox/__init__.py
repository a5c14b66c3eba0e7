"""The code sandbox: run untrusted Python in a fresh, limited process, one at a time or from a pool.

    result = run_python("print(sum(range(10)))", limits=SandboxLimits(wall_s=2))
    result.ok, result.reason, result.stdout, result.isolation  # True, None, "45\n", "bwrap"

Isolation is bubblewrap (namespaces: no network, only a private /tmp writable, host files hidden)
where it works, else rlimits only, which the result's `warning` and the log say plainly.
"""

from inflight.envs.sandbox.limits import Isolation, IsolationChoice, SandboxLimits, merge_limits
from inflight.envs.sandbox.pool import VerifierPool, VerifierPoolConfig, default_pool
from inflight.envs.sandbox.result import RLIMIT_WARNING, Reason, SandboxResult, classify
from inflight.envs.sandbox.runner import bwrap_problem, detect_isolation, resolve_isolation, run_python

__all__ = [
    "RLIMIT_WARNING",
    "Isolation",
    "IsolationChoice",
    "Reason",
    "SandboxLimits",
    "SandboxResult",
    "VerifierPool",
    "VerifierPoolConfig",
    "bwrap_problem",
    "classify",
    "default_pool",
    "detect_isolation",
    "merge_limits",
    "resolve_isolation",
    "run_python",
]
