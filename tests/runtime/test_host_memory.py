"""Freed host memory is reused: a step's large tensors stop costing a page fault per page."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from kvserve.runtime.host_memory import reuse_freed_host_memory

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")

# A fresh interpreter each time: the setting is process-wide, so it must start unset.
_PROBE = """
import resource, sys, torch
from kvserve.runtime.host_memory import reuse_freed_host_memory
applied = reuse_freed_host_memory() if sys.argv[1] == "on" else False
x = torch.ones(16 << 20)  # 64 MiB, above glibc's largest automatic mmap threshold
# Two warm-up rounds: now and then the first one's memory is not where the next lands.
y = x * 2; del y
y = x * 2; del y
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    y = x * 2; del y
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGES_PER_TENSOR = (64 << 20) // os.sysconf("SC_PAGE_SIZE")


def _probe(mode: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], check=True, capture_output=True,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout.split()
    return out[0] == "True", int(out[1])


def test_freed_tensors_are_reused_without_page_faults() -> None:
    probes = [_probe("on") for _ in range(3)]
    assert all(applied for applied, _ in probes)
    # Now and then (about 1 run in 3 under pytest, twice seen on a busy CI machine) a tensor
    # lands on fresh pages: the best of three probes must reuse all but at most one of the four;
    # without the setting every probe faults in all four (below).
    faults = min(f for _, f in probes)
    assert faults <= PAGES_PER_TENSOR + 64, f"{faults} page faults for 4 reused 64 MiB tensors"
    # Without it, glibc maps and faults in every one of them afresh: what the check measures.
    applied, faults = _probe("off")
    assert not applied and faults >= 3 * PAGES_PER_TENSOR


def test_it_can_be_applied_twice() -> None:
    assert reuse_freed_host_memory() and reuse_freed_host_memory()
