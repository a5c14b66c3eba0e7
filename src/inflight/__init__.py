"""inflight: asynchronous reinforcement learning for LLMs (pipeline mode and a Tinker-compatible service)."""

import os

# OpenMP's worker threads sleep when a parallel region ends instead of spinning for it (libgomp spins
# ~300k iterations by default). Set here because libgomp reads it once, when `import torch` loads it: so
# before any of our modules import torch. Spinning threads of two processes (or of two threads of one,
# e.g. the service's trainer and engine) on the same cores starve each other's real work: measured on 2
# cores beside a busy process, a warm-up step took 6-7 s spinning and 0.9 s passive (docs/benchmarks.md,
# `inflight bench train --beside-busy`). An explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
