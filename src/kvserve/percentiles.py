"""Percentiles for every report (benchmarks, simulator): one definition, so figures compare."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between the two nearest ranks (numpy's default);
    None when there are no values."""
    if not values:
        return None
    ordered = sorted(values)
    return at_rank(ordered, (len(ordered) - 1) * q / 100.0)


def at_rank(ordered: Sequence[float], pos: float) -> float:
    """The value at fractional rank `pos` of sorted `ordered`, linear between neighbours."""
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
