"""The built-in demo model: a small Llama with deterministic random weights, made locally.

It lets `kvserve serve` and `LLM()` run with no download. Its text is meaningless by design.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvserve.model import demo_model_config, write_random_checkpoint

DEMO_MODEL_NAME = "kvserve-demo-llama"
DEMO_SEED = 1234


def demo_model_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the demo checkpoint lives: `$KVSERVE_CACHE` or ~/.cache/kvserve, then the name."""
    root = Path(cache_dir or os.environ.get("KVSERVE_CACHE") or Path.home() / ".cache/kvserve")
    return root / f"{DEMO_MODEL_NAME}-v1"


def ensure_demo_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The demo checkpoint's directory, written on first use."""
    return ensure_random_checkpoint(demo_model_dir(cache_dir), demo_model_config(), DEMO_SEED)


def ensure_random_checkpoint(target: Path, config: dict[str, Any], seed: int) -> Path:
    """`target`, holding a random-weight checkpoint of `config` written on first use
    (atomically, so two processes starting at once never see half a checkpoint)."""
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users
        write_random_checkpoint(staging, config, seed=seed)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").exists():  # lost a race only if the winner is whole
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
