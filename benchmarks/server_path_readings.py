"""What the server-path bench reads from a process: clocks at a moment, and one repeat's sample."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Sample:
    """One repeat of one side, over all its prompts' decodes: wall ms, CPU ms and voluntary
    context switches per token. `instance` numbers the (server process, offline process) pair
    that ran it."""

    side: str
    repeat: int
    itl_ms: float
    cpu_ms_per_token: float
    switches_per_token: float
    tokens: int
    client_cpu_ms_per_token: float | None = None  # the server side's client (None offline)
    instance: int = 0

    def row(self) -> dict[str, Any]:
        client = self.client_cpu_ms_per_token
        return {"side": self.side, "instance": self.instance, "repeat": self.repeat,
                "itl_ms": round(self.itl_ms, 2),
                "cpu_ms_per_token": round(self.cpu_ms_per_token, 2),
                "switches_per_token": round(self.switches_per_token, 1), "tokens": self.tokens,
                "client_cpu_ms_per_token": None if client is None else round(client, 3)}

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Sample:
        return cls(row["side"], row["repeat"], row["itl_ms"], row["cpu_ms_per_token"],
                   row["switches_per_token"], row["tokens"], row["client_cpu_ms_per_token"],
                   row["instance"])


@dataclass(frozen=True, slots=True)
class Reading:
    """A process's clocks at one moment: wall (perf_counter), CPU s, voluntary switches."""

    wall: float
    cpu_s: float
    switches: int

    def __sub__(self, other: Reading) -> Reading:
        return Reading(self.wall - other.wall, self.cpu_s - other.cpu_s,
                       self.switches - other.switches)


def self_reading() -> Reading:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return Reading(time.perf_counter(), usage.ru_utime + usage.ru_stime, usage.ru_nvcsw)


def proc_reading(pid: int) -> Reading:
    """`pid`'s clocks, summed over its threads (/proc/PID/stat and each task's status)."""
    now = time.perf_counter()
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    switches = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        line = next(ln for ln in status.splitlines() if ln.startswith("voluntary_ctxt"))
        switches += int(line.split()[1])
    return Reading(now, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"),
                   switches)


def make_sample(side: str, repeat: int, spans: Sequence[tuple[Reading, int]],
                client_cpu_s: float | None = None, instance: int = 0) -> Sample:
    """One repeat from each request's (last - first reading, tokens after the first)."""
    tokens = sum(n for _, n in spans)
    return Sample(side, repeat, 1e3 * sum(r.wall for r, _ in spans) / tokens,
                  1e3 * sum(r.cpu_s for r, _ in spans) / tokens,
                  sum(r.switches for r, _ in spans) / tokens, tokens,
                  None if client_cpu_s is None else 1e3 * client_cpu_s / tokens, instance)
