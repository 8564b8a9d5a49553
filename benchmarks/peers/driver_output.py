"""The peer drivers' one output contract: exactly one JSON object on stdout, everything else on
stderr. Imported by the driver scripts from their own folder (they run in the peer's venv,
`python benchmarks/peers/DRIVER.py`, so this folder is on sys.path); imports nothing from
kvserve or the peer."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
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


def vm_hwm_kib(pid: int | str) -> int | None:
    """The peak resident set (`VmHWM`, KiB) of process `pid`, or None if it is gone or the
    kernel has no /proc."""
    try:
        text = Path(f"/proc/{pid}/status").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return None


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, found by scanning /proc/*/stat for parent ids."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after
            # its last ")".
            fields = stat.read_text(encoding="ascii", errors="replace").rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, []))
    return found


def peak_rss_mib() -> float | None:
    """The sum of the peak resident sets (`VmHWM`) of this process and its live descendants
    (vLLM's engine-core process), in MiB; None without /proc. The peaks may fall at different
    moments, so for several processes the sum bounds their joint peak from above."""
    pids = [os.getpid(), *descendants(os.getpid())]
    kib = [k for k in map(vm_hwm_kib, pids) if k is not None]
    return sum(kib) / 1024 if kib else None
