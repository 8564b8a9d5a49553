"""The process-tree RSS sampler on real processes: a child that starts a grandchild holding
~120 MB, the grandchild found both ways (task children files, /proc/*/stat scan)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve.bench.proc_memory import MIB, TreeRssSampler, rss_bytes, tree_pids, tree_rss_bytes

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")

HOLD_MB = 120
# The grandchild touches every page of its buffer (bytearray zero-fills), says so, and waits.
GRANDCHILD = (f"import sys, time; b = bytearray({HOLD_MB} << 20); print('ready', flush=True); "
              "time.sleep(60)")
# The child only starts the grandchild and relays its line: the memory is one level further down.
CHILD = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', sys.argv[1]], "
         "stdout=subprocess.PIPE, text=True); print(p.stdout.readline().strip(), p.pid, "
         "flush=True); p.wait()")


Tree = tuple[subprocess.Popen[str], int]


@pytest.fixture()
def tree() -> Iterator[Tree]:
    """(the child, the grandchild's pid) once the grandchild holds its memory."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, GRANDCHILD], stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout is not None
    ready, grandchild = child.stdout.readline().split()
    assert ready == "ready"
    try:
        yield child, int(grandchild)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(grandchild), signal.SIGTERM)
        child.wait(30)


@pytest.mark.parametrize("use_task_files", [True, False])
def test_the_tree_holds_the_grandchild(tree: Tree, use_task_files: bool) -> None:
    child, grandchild = tree
    assert tree_pids(child.pid, use_task_files=use_task_files) == [child.pid, grandchild]


def test_peak_counts_the_grandchild_and_stops_cleanly(tree: Tree) -> None:
    child, grandchild = tree
    assert rss_bytes(child.pid) < HOLD_MB * MIB <= rss_bytes(grandchild)
    with TreeRssSampler(child.pid, interval_s=0.05) as sampler:
        time.sleep(0.3)
        thread = sampler._thread
    assert thread is not None and not thread.is_alive()
    assert sampler.start_bytes is not None and sampler.peak_bytes is not None
    assert HOLD_MB * MIB < sampler.start_bytes <= sampler.peak_bytes
    figures = sampler.mib()
    assert HOLD_MB < figures["start_rss_mib"] <= figures["peak_rss_mib"]  # type: ignore[operator]
    sampler.stop()  # idempotent


def test_the_tree_exiting_mid_sampling_is_no_error(tree: Tree) -> None:
    child, grandchild = tree
    with TreeRssSampler(child.pid, interval_s=0.02) as sampler:
        os.kill(grandchild, signal.SIGTERM)
        child.wait(30)
        time.sleep(0.1)
        assert sampler.peak_bytes is not None and sampler.peak_bytes > HOLD_MB * MIB
    assert tree_pids(child.pid) == [] and tree_rss_bytes(child.pid) == 0
    assert rss_bytes(child.pid) == 0
