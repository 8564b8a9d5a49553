"""kvserve's development harnesses: what we run to build kvserve, not what a user runs against
their own deployment (that is `kvserve bench`). Run from the repository root with the venv:
`python -m benchmarks COMMAND ...`; benchmarks/README.md lists every command and why it lives here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""The repository root, which holds this package (it is not installed with kvserve)."""


def with_repo_on_path(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the repository root first on PYTHONPATH, so a child process started with
    `python -m benchmarks.X` finds this package from any working directory."""
    paths = [str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    return dict(env, PYTHONPATH=os.pathsep.join(paths))
