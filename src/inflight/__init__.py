"""inflight: asynchronous reinforcement learning for LLMs (pipeline mode and a Tinker-compatible service)."""

import os

from inflight.malloc_tuning import tune_malloc

# OpenMP's idle worker threads spin for at most GOMP_SPINCOUNT iterations (libgomp's default: 300,000)
# before they sleep. Set here because libgomp reads it once, when `import torch` loads it: so before any of
# our modules import torch. Spinning threads of two processes (or of the service's trainer and engine
# threads) on the same cores starve each other's work; never spinning makes every small operation wake a
# sleeping thread. Measured on 2 cores (docs/benchmarks.md): `inflight bench grpo` 122-147 completions/s
# alone and 12.8 beside a busy process at the default, 89-95 and 65 with OMP_WAIT_POLICY=PASSIVE, 127 and
# 59 (the fair share) at 3,000. The user's own GOMP_SPINCOUNT or OMP_WAIT_POLICY wins.
os.environ.setdefault("GOMP_SPINCOUNT", "3000")
# A process where two threads run torch (the service's training worker and its sampling engine; the bench's
# main thread beside either) has two OpenMP teams, and libgomp then manages more threads than there are
# CPUs: it "throttles" every wait to 100 spins (its default policy) before sleeping, so each small parallel
# op pays a futex wake-up (a 8x8x128 by 8x128x64 bmm: 10-12 us with one team, 25-30 us with two).
# OMP_WAIT_POLICY=ACTIVE raises that throttled spin to 1,000 and, GOMP_SPINCOUNT being set, leaves the
# ordinary spin at 3,000 (11-14 us with two teams; the service's sampling ~+21%, docs/benchmarks.md).
# Without a GOMP_SPINCOUNT, ACTIVE would spin for minutes: set only beside one.
if os.environ.get("GOMP_SPINCOUNT") and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "ACTIVE"

# Freed tensor memory stays in the process for the next step instead of being faulted in again
# (malloc_tuning.py: ~12% of the service's batched forward_backward on 2 cores). The user's allocator
# settings win.
tune_malloc()

__version__ = "0.1.0"
