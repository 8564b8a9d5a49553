"""`python -m benchmarks knobs`: a knob is set for one run and restored after it."""

from __future__ import annotations

import argparse

from benchmarks.knobs_cli import _setting
from kvserve.gateway.core.pipeline import cache_aware, precise, prefix_hash
from kvserve.gateway.core.pipeline.cache_aware import CacheAwarePolicy
from kvserve.gateway.core.pipeline.pickers import BestScore, BoundedLoad


def _cold_factor(policy: CacheAwarePolicy) -> float:
    assert isinstance(policy.picker, BestScore) and isinstance(policy.picker.cold, BoundedLoad)
    return policy.picker.cold.load_factor


def test_cold_load_factor_reaches_the_policies_built_in_the_run_and_is_restored() -> None:
    default = prefix_hash.COLD_LOAD_FACTOR
    with _setting("cold_load_factor", "3.0", argparse.Namespace()):
        assert _cold_factor(CacheAwarePolicy()) == 3.0
        assert precise.COLD_LOAD_FACTOR == cache_aware.COLD_LOAD_FACTOR == 3.0
    assert _cold_factor(CacheAwarePolicy()) == default
    assert precise.COLD_LOAD_FACTOR == cache_aware.COLD_LOAD_FACTOR == default
