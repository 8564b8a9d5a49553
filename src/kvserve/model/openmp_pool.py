"""The OpenMP thread pool of the calling thread, released when another thread takes over the model.

torch's CPU ops (and oneDNN's and kvserve's kernels, which share its libgomp) run each parallel
region on the calling thread's pool. libgomp lets its idle workers spin between regions only while
the threads it manages number no more than the CPUs; past that, each region wakes its workers
through the kernel (a futex round trip per region, ~150 regions per decode step). A model loaded
on one thread and served from another (AsyncEngine's step loop) leaves the loading thread's pool
alive, which tips the count over on a machine with as many compute threads as cores: measured on
SmolLM2-135M with 2 threads on 2 cores, ~220 worker wake-ups per token, against none offline
(docs/benchmarks.md, "Server path per token, real model"). Releasing the loading thread's pool
gives the serving thread the offline engine's behaviour; a later parallel op on the loading
thread builds a new pool, so this only ever costs a pool's start-up.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

_LOG = logging.getLogger(__name__)
_PAUSE_SOFT = 1  # omp_pause_soft (OpenMP 5.0): free the pool's threads, keep the runtime


def _loaded_libgomp() -> Path | None:
    """The libgomp this process has loaded (torch's), from /proc/self/maps; None if there is
    none or no /proc."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        if len(fields) == 6 and Path(fields[5]).name.startswith("libgomp.so"):
            return Path(fields[5])
    return None


def release_calling_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker threads (libgomp's omp_pause_resource_all);
    True if a libgomp pool was released. A no-op (False) where torch does not run on libgomp,
    the runtime predates OpenMP 5.0, or the caller is inside a parallel region."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return False
    path = _loaded_libgomp()
    if path is None:
        return False
    try:
        lib = ctypes.CDLL(str(path))
        pause = lib.omp_pause_resource_all
    except (OSError, AttributeError):
        _LOG.info("OpenMP pool left alone: %s has no omp_pause_resource_all", path)
        return False
    pause.argtypes, pause.restype = (ctypes.c_int,), ctypes.c_int
    return int(pause(_PAUSE_SOFT)) == 0
