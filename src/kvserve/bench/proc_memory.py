"""Resident memory of a process tree, read from /proc (Linux): what a launched server holds.

A server is a process and its descendants (vLLM's API server spawns an engine-core child), so
the figure is the VmRSS of the root plus every descendant's, found through
/proc/PID/task/TID/children where the kernel has it (CONFIG_PROC_CHILDREN), else by reading
every process's parent from /proc/*/stat. Pages shared between those processes count once per
process: the sum is an upper bound on the tree's own memory. A process that exits between two
reads counts 0; nothing here raises for it.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import TracebackType
from typing import Self

PROC = Path("/proc")
MIB = 1 << 20


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, ValueError):  # gone, or not readable: it counts as absent
        return None


def _children_from_task_files(pid: int) -> list[int] | None:
    """`pid`'s children as its threads' children files list them; None without the files."""
    try:
        tasks = list((PROC / str(pid) / "task").iterdir())
    except OSError:
        return []  # the process is gone: no children
    if not (PROC / str(pid) / "task" / str(pid) / "children").exists():
        return None
    children: list[int] = []
    for task in tasks:
        text = _read(task / "children")
        children += [int(c) for c in (text or "").split()]
    return children


def _parents() -> dict[int, list[int]]:
    """Every process's children, from each /proc/PID/stat's parent field."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        stat = _read(entry / "stat")
        if stat is None or ")" not in stat:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def tree_pids(pid: int, *, use_task_files: bool = True) -> list[int]:
    """`pid` and all its descendants alive now (parents before children); [] if `pid` is
    gone. `use_task_files=False` always scans /proc/*/stat (the fallback, for tests)."""
    if not (PROC / str(pid)).exists():
        return []
    by_scan: dict[int, list[int]] | None = None
    order, stack, seen = [], [pid], {pid}
    while stack:
        current = stack.pop()
        order.append(current)
        kids = _children_from_task_files(current) if use_task_files else None
        if kids is None:
            by_scan = _parents() if by_scan is None else by_scan
            kids = by_scan.get(current, [])
        stack += [k for k in kids if k not in seen]
        seen.update(kids)
    return order


def rss_bytes(pid: int) -> int:
    """VmRSS of one process in bytes; 0 if it is gone, a zombie or unreadable."""
    for line in (_read(PROC / str(pid) / "status") or "").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024  # "VmRSS:   1234 kB"
    return 0


def tree_rss_bytes(pid: int) -> int:
    """Summed VmRSS of `pid` and its descendants in bytes (0 if `pid` is gone)."""
    return sum(rss_bytes(p) for p in tree_pids(pid))


class TreeRssSampler:
    """Samples `tree_rss_bytes(pid)` every `interval_s` on a daemon thread from `start()` to
    `stop()` (or over a `with` block). `start_bytes` is the reading taken in `start()`,
    `peak_bytes` the largest reading so far (`stop()` takes a last one); both None without
    /proc. `stop()` is idempotent and returns once the thread has ended."""

    def __init__(self, pid: int, interval_s: float = 0.5) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.start_bytes: int | None = None
        self.peak_bytes: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        if not PROC.is_dir():
            return
        value = tree_rss_bytes(self.pid)
        self.peak_bytes = value if self.peak_bytes is None else max(self.peak_bytes, value)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> None:
        """Take the first reading, then keep sampling on the thread; once only."""
        assert self._thread is None and not self._stop.is_set(), "a sampler starts once"
        self._sample()
        self.start_bytes = self.peak_bytes
        self._thread = threading.Thread(target=self._loop, name=f"rss-{self.pid}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread and take a last reading (when it was running)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join()
        self._sample()

    def mib(self) -> dict[str, float | None]:
        """`start_rss_mib` and `peak_rss_mib`, rounded to 0.1 MiB (None when not read)."""
        return {"start_rss_mib": _to_mib(self.start_bytes),
                "peak_rss_mib": _to_mib(self.peak_bytes)}

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _to_mib(value: int | None) -> float | None:
    return None if value is None else round(value / MIB, 1)
