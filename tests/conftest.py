"""Repository-wide test helpers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Public traces the repository does not ship, beside the clone by default (docs/traces.md).
SHARED = Path(os.environ.get("KVSERVE_SHARED")
              or Path(__file__).resolve().parents[1].parent / "shared")


def _split_cores_over_xdist_workers() -> None:
    """Under pytest-xdist, each worker (and every server it starts) gets its share of the cores
    as OMP_NUM_THREADS, which torch and kvserve's --num-threads default honour. Two workers of
    two OpenMP threads each on two cores spin at each other's barriers: measured on SmolLM2's
    40 chats, 25 s a worker against 11 s with one thread each (docs/operations.md)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                          else os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:  # imported before this file: set its pool too
        sys.modules["torch"].set_num_threads(threads)


_split_cores_over_xdist_workers()


def shared_file(relative: str) -> Path:
    """A public data file (under KVSERVE_SHARED, default ../shared), or a skip that names it and
    says where to get it."""
    path = SHARED / relative
    if not path.exists():
        pytest.skip(f"{path} is absent: this test reads a public trace the repository does not "
                    "ship (docs/traces.md says where to get it; KVSERVE_SHARED=DIR points here)")
    return path


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which a bare install may lack
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """Under `--dist loadfile` (`make test`), the longest files first and the files sharing
    one session fleet together (tests/scheduling.py); any other mode stays xdist's own."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from tests.scheduling import LongestFirstFileScheduling

    return LongestFirstFileScheduling(config, log)
