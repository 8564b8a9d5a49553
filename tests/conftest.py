"""Repository-wide test helpers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Public traces the repository does not ship, beside the clone by default (docs/traces.md).
SHARED = Path(os.environ.get("KVSERVE_SHARED")
              or Path(__file__).resolve().parents[1].parent / "shared")


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
