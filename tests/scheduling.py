"""How `make test` (`pytest -n 2 --dist loadfile`) hands test files to its two processes: the
longest first, so the run does not end on one process with a minute-long file while the other
idles (xdist's own order is by number of tests: the few-but-slow fleet files came last), and the
files that share one fleet (tests/ops/conftest.py's session `servers`, tests/gateway/conftest.py's
package `fleet`) as one unit, so that fleet starts once, not once in each process or again after
another file ran in between.

Only the order and the grouping change: every test runs, in the process its file's unit went to.
The costs are measured seconds per unit (tests/data/test_file_seconds.json: after
`pytest --junitxml=run.xml`, `python -m tests.scheduling run.xml` writes it); a file not listed
costs a second a test. A stale file only makes the order less good, never a test wrong."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path
from typing import Any

from xdist.scheduler import LoadFileScheduling

SECONDS = Path(__file__).resolve().parent / "data" / "test_file_seconds.json"
# Files whose tests share one fleet: one work unit each group, so the fleet starts once. A
# package-scoped fixture is torn down as soon as a process runs a test from elsewhere, so
# tests/gateway's `fleet` (two workers) also started again whenever another unit came between.
_OPS = "tests/ops (conftest.py's session servers)"
_GATEWAY = "tests/gateway (conftest.py's package fleet)"
SHARED_FLEETS = {
    "tests/ops/test_doctor.py": _OPS,
    "tests/ops/test_dashboard.py": _OPS,
    **{f"tests/gateway/{name}.py": _GATEWAY
       for name in ("test_proxy", "test_proxy_faults", "test_discovery_proxy",
                    "test_precise_proxy", "test_shared_workers_proxy")},
}
UNKNOWN_S_PER_TEST = 1.0


def unit_of(nodeid: str) -> str:
    """The work unit a test belongs to: its file, or its file's shared-fleet group."""
    path = nodeid.split("::", 1)[0]
    return SHARED_FLEETS.get(path, path)


class LongestFirstFileScheduling(LoadFileScheduling):
    """xdist's loadfile scheduling, its units grouped by `unit_of` and sent longest first."""

    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        self.seconds: dict[str, float] = (json.loads(SECONDS.read_text())
                                          if SECONDS.exists() else {})
        self.ordered = False

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def _assign_work_unit(self, node: Any) -> None:
        if not self.ordered:  # the queue is complete by the first assignment
            units = sorted(self.workqueue.items(), key=lambda item: -self.cost(*item))
            self.workqueue.clear()
            self.workqueue.update(units)
            self.ordered = True
        super()._assign_work_unit(node)

    def cost(self, unit: str, nodeids: dict[str, bool]) -> float:
        return self.seconds.get(unit, UNKNOWN_S_PER_TEST * len(nodeids))


def file_of(classname: str) -> str:
    """A junit `classname` (tests.ops.test_doctor, or ...test_x.TestClass) -> its test file."""
    parts = classname.split(".")
    root = Path(__file__).resolve().parents[1]
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (root / path).exists():
            return path
    return classname


def record(reports: list[Path]) -> dict[str, float]:
    """Seconds per unit (setup, call and teardown) from pytest's junit XML reports."""
    seconds: dict[str, float] = defaultdict(float)
    for report in reports:
        for case in ET.parse(report).iter("testcase"):
            seconds[unit_of(file_of(case.get("classname", "")))] += float(case.get("time", 0))
    return {unit: round(s, 1) for unit, s in sorted(seconds.items(), key=lambda kv: -kv[1])}


if __name__ == "__main__":
    SECONDS.write_text(json.dumps(record([Path(p) for p in sys.argv[1:]]), indent=1) + "\n")
