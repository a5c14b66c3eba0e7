"""`import inflight` keeps freed tensor memory in the process (glibc's malloc thresholds raised), unless the
user chose their own allocator or thresholds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from inflight.malloc_tuning import MMAP_THRESHOLD_BYTES, user_chose_malloc

GLIBC_MAX_DYNAMIC_MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's own threshold never rises past this
PROBE_BYTES = 40 << 20  # over glibc's largest own mmap threshold, under ours
# mallinfo2's hblkhd is the memory malloc holds in mmapped blocks.
PROBE = f"""
import ctypes, json, inflight, torch
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Info
before = mallinfo2().hblkhd
x = torch.empty({PROBE_BYTES}, dtype=torch.uint8)
print(json.dumps({{"mmapped_bytes": mallinfo2().hblkhd - before}}))
"""


def _mmapped_bytes(extra_env: dict[str, str]) -> int:
    env = {k: v for k, v in os.environ.items() if user_chose_malloc({k: v}) is None} | extra_env
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True, timeout=120
    )
    return int(json.loads(out.stdout.strip().splitlines()[-1])["mmapped_bytes"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_a_large_tensor_comes_from_the_heap_and_the_users_thresholds_win() -> None:
    assert MMAP_THRESHOLD_BYTES > PROBE_BYTES > GLIBC_MAX_DYNAMIC_MMAP_THRESHOLD_BYTES
    assert _mmapped_bytes({}) == 0  # from the heap: freed, it stays for the next step
    # The user's own threshold (glibc's largest own here): the tensor is mmapped, as without inflight.
    user_threshold = {"MALLOC_MMAP_THRESHOLD_": str(GLIBC_MAX_DYNAMIC_MMAP_THRESHOLD_BYTES)}
    assert _mmapped_bytes(user_threshold) >= PROBE_BYTES


@pytest.mark.parametrize(
    ("environ", "chosen"),
    [
        ({}, None),
        ({"PATH": "/usr/bin", "LD_PRELOAD": "libfoo.so"}, None),
        ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_"),
        ({"MALLOC_MMAP_THRESHOLD_": "131072"}, "MALLOC_MMAP_THRESHOLD_"),
        ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}, "GLIBC_TUNABLES"),
        ({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2"}, None),
        ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "LD_PRELOAD"),
        ({"LD_PRELOAD": "libtcmalloc_minimal.so.4"}, "LD_PRELOAD"),
    ],
)
def test_the_users_allocator_settings_are_recognised(environ: dict[str, str], chosen: str | None) -> None:
    assert user_chose_malloc(environ) == chosen
