"""Releasing a thread's OpenMP pool ends its worker threads, and torch still computes after."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from kvserve.model.openmp_pool import release_calling_thread_pool

needs_libgomp = pytest.mark.skipif(
    "OpenMP" not in torch.__config__.parallel_info() or (os.cpu_count() or 1) < 2
    or not Path("/proc/self/task").exists(),
    reason="needs torch on OpenMP, two CPUs and /proc")


def _num_threads() -> int:
    return len(list(Path("/proc/self/task").iterdir()))


T = TypeVar("T")


def _in_fresh_thread(fn: Callable[[], T]) -> T:
    """Run fn on a new thread (its own OpenMP pool) and return its result."""
    result: list[T] = []
    worker = threading.Thread(target=lambda: result.append(fn()))
    worker.start()
    worker.join()
    return result[0]


@needs_libgomp
def test_release_ends_the_calling_threads_workers_and_a_later_op_rebuilds_them() -> None:
    big = torch.ones(1 << 22)  # [4M]: above torch's grain size, so the add runs in parallel

    def run() -> tuple[int, bool, int, int, float]:
        torch.set_num_threads(2)
        (big + 1).sum()  # builds this thread's pool: one worker beside this thread
        with_pool = _num_threads()
        released = release_calling_thread_pool()
        without_pool = _num_threads()
        total = float((big + 1).sum())  # a new pool, same answer
        return with_pool, released, without_pool, _num_threads(), total

    with_pool, released, without_pool, rebuilt, total = _in_fresh_thread(run)
    assert released
    assert without_pool == with_pool - 1
    assert rebuilt == with_pool
    assert total == 2.0 * (1 << 22)

