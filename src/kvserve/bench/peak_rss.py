"""The benchmark process's own resident memory, for the systems `kvserve bench engine` runs in it.

Linux only (/proc/self): elsewhere every reading is None. The peak (`VmHWM`) can be reset to the
current resident set (writing 5 to /proc/self/clear_refs), so a system's peak is measured from
just before its load; what earlier systems left resident (freed memory the heap keeps, torch's
own state) is in that baseline, and `VmRSS` at the reset says how much it was.
"""

from __future__ import annotations

from pathlib import Path

PROC_SELF = Path("/proc/self")


def status_mib(field: str, proc: Path = PROC_SELF) -> float | None:
    """A `kB` field of /proc/self/status (`VmHWM`, `VmRSS`) in MiB, or None without /proc."""
    try:
        text = (proc / "status").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == field:
            return int(value.split()[0]) / 1024
    return None


def reset_peak_rss(proc: Path = PROC_SELF) -> bool:
    """Set this process's peak resident set to its current one; False where the kernel cannot
    (no /proc, or a kernel before 4.0), in which case `VmHWM` still counts from process start."""
    try:
        (proc / "clear_refs").write_text("5", encoding="ascii")
    except OSError:
        return False
    return True
