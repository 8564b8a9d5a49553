"""One build of kvserve's CPU kernels for every server a test starts.

The test harnesses give each server process a KVSERVE_CACHE of its own (a temporary directory),
which also held the kernel library: every server compiled csrc/ again (about 11 s of CPU, twice
for a two-rank worker, eight times at once for a fleet). `cache_with_shared_kernels` makes that
cache's `kernels/` a link to the directory the test process itself builds into (its own
KVSERVE_CACHE, else ~/.cache/kvserve), built once here first. The rest of the cache stays the
test's own. The build itself is tested where it is the subject (tests/model/test_cpu_kernels.py,
with caches of their own)."""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
from pathlib import Path


@functools.cache
def _shared_kernels_dir() -> Path:
    from kvserve.model import cpu_kernels  # torch: imported only where a server is started

    root = Path(os.environ.get("KVSERVE_CACHE") or Path.home() / ".cache" / "kvserve")
    shared = root / "kernels"
    shared.mkdir(parents=True, exist_ok=True)
    isa, compiler = cpu_kernels.kernel_set(), cpu_kernels.find_compiler()
    if isa is not None and compiler is not None:
        # Built (or found) now, before servers start together; a failure is the servers' to
        # report, as it would be without the link.
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            cpu_kernels.build(compiler, isa)
    return shared


def cache_with_shared_kernels(cache: Path) -> Path:
    """`cache` (created if absent), its `kernels/` the shared build directory; returns `cache`."""
    cache.mkdir(parents=True, exist_ok=True)
    link = cache / "kernels"
    if not link.is_symlink() and not link.exists():
        link.symlink_to(_shared_kernels_dir(), target_is_directory=True)
    return cache
