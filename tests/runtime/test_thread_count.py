"""How many torch threads a rank takes: --num-threads, else OMP_NUM_THREADS, else its cores."""

from __future__ import annotations

import os

import pytest

from kvserve.runtime.engine_args import EngineArgs


def test_explicit_threads_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert EngineArgs(num_threads=5).resolve_num_threads() == 5
    assert EngineArgs(num_threads=0).resolve_num_threads() == 1


def test_omp_num_threads_sets_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert EngineArgs().resolve_num_threads() == 3
    assert EngineArgs(tensor_parallel_size=2).resolve_num_threads() == 3  # a rank's own


@pytest.mark.parametrize("value", [None, "", "0", "two", "4,2"])
def test_without_a_usable_omp_num_threads_the_cores_are_split_over_the_ranks(
        monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", value)
    cores = len(os.sched_getaffinity(0))
    assert EngineArgs().resolve_num_threads() == cores
    assert EngineArgs(tensor_parallel_size=2).resolve_num_threads() == max(1, cores // 2)
