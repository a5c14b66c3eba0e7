"""glibc malloc kept from giving tensor memory back to the kernel between steps (`tune_malloc`).

By default glibc serves an allocation over its mmap threshold (dynamic, at most 32 MiB) with a fresh
mmap, unmapped again on free, and trims its heap's free top past twice that. A training or sampling step
allocates and frees the same large activations, logits and gradients every time, so each step faults
every page of them in again and the kernel zeroes each one: on 2 cores (AMD EPYC Zen 3) the service's
forward_backward of 8 adapters x 2 datums x 64 tokens, batched and then one job at a time, took ~11,000
minor page faults a repeat, and its batched call ran ~12% slower than with the thresholds raised
(docs/benchmarks.md, twenty-eighth session). With them raised, freed blocks stay in the process and
the next step reuses them. The trainer and the engine showed no gain beyond the noise, here nor (with
`make run`) on a Zen 4 (twenty-fourth session). The cost: up to `TRIM_THRESHOLD_BYTES` of freed memory stays
resident per heap, and allocations under `MMAP_THRESHOLD_BYTES` come from the heap, where fragmentation
can hold more (peak RSS +60-70 MB in `inflight bench serve` and `inflight bench train`).

Written by hand because no library does it: PyTorch's CPU allocator is glibc's malloc, and the usual
alternative (jemalloc or tcmalloc through LD_PRELOAD) must be set before the process starts.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 64 << 20  # allocations from here up are still mmapped (and unmapped on free)
TRIM_THRESHOLD_BYTES = 64 << 20  # freed memory at a heap's top kept resident, up to this
# mallopt(3)'s parameter numbers (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Any of these set means the user chose their allocator or its settings: theirs win.
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def user_chose_malloc(environ: dict[str, str] | os._Environ[str]) -> str | None:
    """The setting by which the user chose their own allocator or glibc malloc's thresholds, or None."""
    for name in _USER_SETTINGS:
        if name in environ:
            return name
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    preload = environ.get("LD_PRELOAD", "")
    if any(allocator in preload for allocator in _OTHER_ALLOCATORS):
        return "LD_PRELOAD"
    return None


def tune_malloc() -> bool:
    """Raise glibc malloc's mmap and trim thresholds for this process (see the module docstring); True when
    done. Not on another C library, nor where the user chose their allocator or these thresholds
    (`user_chose_malloc`)."""
    if not _glibc():
        return False
    if user_chose_malloc(os.environ) is not None:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no symbol table to search, or a libc without mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt answers 1 on success; either call also turns off glibc's own moving of the thresholds.
    done = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and done
    if not done:
        log.debug("glibc refused the malloc thresholds; it keeps its defaults")
    return done


def _glibc() -> bool:
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError, AttributeError):  # no such name here: not glibc
        return False
