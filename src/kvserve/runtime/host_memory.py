"""Keep freed host memory in the process heap, so each step's tensors reuse it without faults.

glibc serves every allocation above its mmap threshold (32 MiB at most, adjusted at run time)
with a fresh `mmap` and returns it with `munmap` when freed, and it trims the heap top back to
the kernel. A prefill step allocates and frees activations of many MiB dozens of times, so each
would be faulted in page by page (the kernel zeroes each page) and handed back, slowing the
step (docs/benchmarks.md, offline engine). Raising both thresholds keeps that memory mapped and
reused. vLLM's CPU build gets the same effect from tcmalloc; this needs no preloaded library.

The cost: the process keeps its peak heap mapped (it is reused, not leaked). Process-wide,
so the engine applies it once at start-up, on CPU only, unless `EngineArgs.reuse_host_memory`
is False.
"""

from __future__ import annotations

import ctypes
import platform
import sys

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 30  # allocations below this come from the heap
TRIM_THRESHOLD_BYTES = (1 << 31) - 1  # never hand the heap top back (mallopt takes an int)


def reuse_freed_host_memory() -> bool:
    """Make glibc keep freed memory for reuse (see the module docstring). Returns True when
    applied, False where the C library is not glibc (nothing changed). Idempotent."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
