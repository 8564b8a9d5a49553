"""Which alerts must fire, and when, on the series recorded under each planted fault (by
tests/ops/test_live_faults.py, committed in tests/data/fault_series): a function of the
recording per fault, giving the scrape index -> the exact set of firing alerts there."""

from __future__ import annotations

from collections.abc import Callable

from tests.ops.fault_series import UP, Recording

# The audit that proves the leak fails once, when the worker first idles: its alert fires
# then and is over by the time the leak alerts' `for` has passed.
LEAK = frozenset({"KVServeBlockLeakWhileIdle", "KVServeBlocksHeldByDeadRequests",
                  "KVServeFreesBehindAllocations"})
QUIET: frozenset[str] = frozenset()


def _first(recording: Recording, hit: Callable[[dict[str, float]], bool]) -> int:
    return next(i for i, s in enumerate(recording.scrapes) if hit(s))


def slow_rank(recording: Recording) -> dict[int, frozenset[str]]:
    last = len(recording.scrapes) - 1
    assert last >= 16, "record the slow steps long enough for the alert's 5m rate and 10m for"
    return {1: QUIET, last: frozenset({"KVServeAllReduceSlow"})}


def leak(recording: Recording) -> dict[int, frozenset[str]]:
    last = len(recording.scrapes) - 1
    assert last >= 12, "record the idle worker long enough for the leak alerts' 10m for"
    return {0: QUIET, last: LEAK}


def corruption(recording: Recording) -> dict[int, frozenset[str]]:
    """Quiet before; the corruption alert alone from the first scrape that counts it."""
    found = _first(recording, lambda s: any(
        k.startswith("kvserve:kv_corruption_detections_total{") and v > 0 for k, v in s.items()))
    last = min(len(recording.scrapes) - 1, found + 5)
    return {found - 1: QUIET, found: frozenset({"KVServeCacheCorruption"}),
            last: frozenset({"KVServeCacheCorruption"})}


def lost_rank(recording: Recording) -> dict[int, frozenset[str]]:
    """Quiet before the error; the error alone when it is counted; once the worker is gone
    (3 failed scrapes), the scrape-down alert."""
    failed = _first(recording, lambda s: any(
        k.startswith("kvserve:collective_errors_total{") and v > 0 for k, v in s.items()))
    gone = _first(recording, lambda s: s.get(UP) == 0)
    return {failed - 1: QUIET, failed: frozenset({"KVServeCollectiveErrors"}),
            gone + 2: frozenset({"KVServeWorkerScrapeDown"})
            | (frozenset({"KVServeCollectiveErrors"}) if gone + 2 < failed + 4 else QUIET)}


EXPECTED: dict[str, Callable[[Recording], dict[int, frozenset[str]]]] = {
    "tp_slow": slow_rank, "tp_leak": leak, "leak": leak, "tp_corruption": corruption,
    "corruption": corruption, "tp_killed": lost_rank}
