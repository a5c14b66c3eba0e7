"""inflight: asynchronous reinforcement learning for LLMs (pipeline mode and a Tinker-compatible service)."""

import os

# OpenMP's idle worker threads spin for at most GOMP_SPINCOUNT iterations (libgomp's default: 300,000)
# before they sleep. Set here because libgomp reads it once, when `import torch` loads it: so before any of
# our modules import torch. Spinning threads of two processes (or of the service's trainer and engine
# threads) on the same cores starve each other's work; never spinning makes every small operation wake a
# sleeping thread. Measured on 2 cores (docs/benchmarks.md): `inflight bench grpo` 122-147 completions/s
# alone and 12.8 beside a busy process at the default, 89-95 and 65 with OMP_WAIT_POLICY=PASSIVE, 127 and
# 59 (the fair share) at 3,000. The user's own GOMP_SPINCOUNT or OMP_WAIT_POLICY wins.
os.environ.setdefault("GOMP_SPINCOUNT", "3000")

__version__ = "0.1.0"
