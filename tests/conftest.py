"""Repository-wide test helpers."""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


def shared_file(relative: str) -> Path:
    """A file under ../shared, or a skip that says what is missing and why."""
    path = SHARED / relative
    if not path.exists():
        pytest.skip(f"{path} is absent: this test reads the shared data (../shared/README.md)")
    return path
