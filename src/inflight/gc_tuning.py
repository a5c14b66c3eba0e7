"""Python's cyclic garbage collector kept off what a process builds once (`long_lived_frozen`).

CPython's collector traces every tracked object of the generations it collects. Its oldest generation holds
everything that survived, here ~365,000 objects of torch's, transformers' and our imports alone, so a
process that allocates as it runs (the rollouts' episodes and requests, the engine's bookkeeping, the
service's requests) pays a trace of that whole heap every few seconds: during `inflight run blackjack` on
2 cores (AMD EPYC Zen 3), 22 full collections of up to 420 ms in 181 s, 1.55-2.27 s of each 100 GRPO
steps' 35-57 s, on the core that runs the engine and the rollouts (docs/benchmarks.md, thirty-fourth
session). `gc.freeze()` moves every object alive into a permanent generation the collector never traces;
objects made afterwards are collected as before. Frozen objects are still freed by reference counting: only
reference cycles among them (garbage already, or garbage later) stay until `gc.unfreeze()`, which the
context manager calls at its end. So no collection first (a full one costs what the freeze saves, and a
test process starts hundreds of runs and services), and a process running several in turn (the tests)
collects each one's cycles once it is over.

Written by hand: two calls of the standard library, placed where a run or a server has built what it keeps.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_long_lived() -> None:
    """Exempt every object alive now from the cyclic collector for good (see the module docstring). For a
    process that lives as long as what it has built (the pipeline's trainer process, `serve-engine`, a Ray
    replica's actor); code that may run several times in one process uses `long_lived_frozen`, which
    unfreezes them at its end."""
    gc.freeze()


@contextlib.contextmanager
def long_lived_frozen() -> Iterator[None]:
    """Within the block, the objects alive at its start are exempt from the cyclic collector (see the
    module docstring). At its end they are collected again as usual. Enter it
    once the process has built what the block keeps (the model, the engine, the trainer); nested or
    overlapping blocks are harmless, the first end unfreezes them all."""
    freeze_long_lived()
    try:
        yield
    finally:
        gc.unfreeze()
