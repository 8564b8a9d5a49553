"""The peer drivers' one output contract: exactly one JSON object on stdout, everything else on
stderr. Imported by the driver scripts from their own folder (they run in the peer's venv,
`python benchmarks/peers/DRIVER.py`, so this folder is on sys.path); imports nothing from
kvserve or the peer."""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from collections.abc import Callable
from typing import Any


def print_result(driver: str, produce: Callable[[], dict[str, Any]]) -> int:
    """Run `produce` with stdout sent to stderr (vLLM logs there), then write its result as one
    JSON line on the real stdout; 0 on success. Any failure prints its traceback (and, for a
    missing peer or a bad spec, a one-line summary naming `driver`) on stderr and returns 1."""
    stdout = sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr):
            result = produce()
    except (ImportError, OSError, ValueError, KeyError) as exc:  # no peer, bad spec
        traceback.print_exc()
        print(f"{driver}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except Exception:  # a vLLM API change or a bug: keep the traceback
        traceback.print_exc()
        return 1
    stdout.write(json.dumps(result) + "\n")
    stdout.flush()
    return 0
