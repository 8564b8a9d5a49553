"""Finding a server's rank processes and waiting for them to be gone (Linux /proc)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from tests.server.harness import wait_until


def child_pids(pid: int) -> list[int]:
    """The direct children of process `pid` (a server's rank processes)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            children += [int(c) for c in (task / "children").read_text().split()]
    return children


def is_gone(pid: int) -> bool:
    """Exited (a zombie its parent has not reaped yet counts as exited)."""
    with contextlib.suppress(OSError):
        return "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    return True


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> None:
    for pid in pids:
        wait_until(lambda p=pid: is_gone(p), timeout_s, f"rank process {pid} to exit")
