"""The doctor's differential diagnosis on tensor-parallel workers: a failed collective, a slow
rank, a corrupt cache and a leak are each named as the cause, the others ruled out with their
numbers, and none is mistaken for another."""

from __future__ import annotations

from kvserve.ops.diagnose import diagnose
from kvserve.ops.findings import Finding, Problem, Severity
from kvserve.ops.scrape import Metrics
from tests.ops.test_diagnose import W0, observation, worker_metrics

BOUNDS = ("0.001", "0.005", "0.05", "0.1", "1.0", "+Inf")


def tp_metrics(*, reduce_counts: tuple[float, ...] = (0,) * 6, skew_counts: tuple[float, ...]
               = (0,) * 6, errors: float = 0, slowest: int = 0, **worker: float) -> Metrics:
    """A TP=2 worker: `worker_metrics` plus cumulative all_reduce and skew bucket counts."""
    base = worker_metrics(**worker)
    m = 'model_name="m"'
    lines = [f"kvserve:tensor_parallel_size{{{m}}} 2",
             f"kvserve:collective_slowest_rank{{{m}}} {slowest}",
             f'kvserve:collective_errors_total{{{m},op="all_reduce",kind="timeout"}} {errors}',
             f'kvserve:collective_errors_total{{{m},op="all_gather",kind="rank_lost"}} 0']
    lines += [f'kvserve:collective_duration_seconds_bucket{{{m},op="all_reduce",backend="gloo",'
              f'le="{b}"}} {c}' for b, c in zip(BOUNDS, reduce_counts, strict=True)]
    lines += [f'kvserve:collective_rank_skew_seconds_bucket{{{m},le="{b}"}} {c}'
              for b, c in zip(BOUNDS, skew_counts, strict=True)]
    extra = Metrics.from_text("\n".join(lines) + "\n")
    return Metrics({**base.families, **extra.families}, base.samples + extra.samples)


def busy(**kw) -> dict:
    return dict(held=40, running=4, live=4, queries=10_000, hits=9_000) | kw


def findings(first: Metrics, second: Metrics) -> tuple[list[Finding], Finding]:
    report = diagnose([observation(W0, first, second)])
    (diff,) = [f for f in report.findings if f.title.startswith("differential diagnosis")]
    return [f for f in report.findings if f.severity > Severity.INFO], diff


def line(diff: Finding, cause: str) -> str:
    (found,) = [e for e in diff.evidence if e.startswith(cause + ":")]
    return found


def test_healthy_tp_worker_rules_every_cause_out_with_numbers():
    first = tp_metrics(**busy(allocated=1000, freed=1000))
    second = tp_metrics(reduce_counts=(200, 990, 1000, 1000, 1000, 1000),
                        skew_counts=(40, 50, 50, 50, 50, 50), **busy(allocated=1100, freed=1100))
    problems, diff = findings(first, second)
    assert problems == []
    assert diff.title == "differential diagnosis: no fault among the known causes"
    assert line(diff, "collective") == ("collective: ruled out: collectives healthy: all_reduce "
                                        "p99 <= 5 ms over 1000 calls over the last 5 s, 0 errors "
                                        "since start")
    assert line(diff, "corruption").startswith("corruption: ruled out: 0 corruption detections")


def test_a_failed_collective_is_the_cause_and_the_cache_is_not():
    first = tp_metrics(**busy())
    second = tp_metrics(errors=1, reduce_counts=(100,) * 6, **busy())
    problems, diff = findings(first, second)
    assert [(f.problem, f.severity) for f in problems] == [(Problem.COLLECTIVE,
                                                            Severity.CRITICAL)]
    assert "1 all_reduce failures of kind timeout" in problems[0].evidence[0]
    assert diff.title == "differential diagnosis: collective"
    assert line(diff, "corruption").startswith("corruption: ruled out: 0 corruption")
    assert line(diff, "leak").startswith("leak: ruled out")


def test_a_collective_failed_before_the_window_is_still_the_cause():
    # The doctor reads the worker in its grace period after the failure: no new error in the
    # window, yet the group is gone; collectives must not be "ruled out".
    first = tp_metrics(errors=1, **busy())
    second = tp_metrics(errors=1, **busy())
    problems, diff = findings(first, second)
    assert [(f.problem, f.severity) for f in problems] == [(Problem.COLLECTIVE,
                                                            Severity.CRITICAL)]
    assert "1 all_reduce failures of kind timeout since start (0 in the last" in \
        problems[0].evidence[0]
    assert line(diff, "collective").startswith("collective: THE CAUSE")


def test_a_slow_rank_is_told_from_a_slow_transport():
    first = tp_metrics(**busy())
    slow_rank = tp_metrics(reduce_counts=(0, 0, 0, 900, 1000, 1000),
                           skew_counts=(0, 0, 0, 40, 50, 50), slowest=1, **busy())
    problems, _ = findings(first, slow_rank)
    (slow,) = problems
    assert slow.problem is Problem.COLLECTIVE and slow.severity is Severity.WARNING
    assert "all_reduce p99 <= 1000 ms" in slow.evidence[0]
    assert "slowest rank 1" in slow.evidence[1]
    slow_net = tp_metrics(reduce_counts=(0, 0, 0, 900, 1000, 1000),
                          skew_counts=(50,) * 6, **busy())
    (slow,) = findings(first, slow_net)[0]
    assert "the transport is slow" in slow.evidence[1]


def test_corruption_on_a_tp_worker_is_not_blamed_on_the_collectives():
    first = tp_metrics(**busy())
    second = tp_metrics(corruption=1, reduce_counts=(500, 1000, 1000, 1000, 1000, 1000),
                        **busy())
    problems, diff = findings(first, second)
    assert [f.problem for f in problems] == [Problem.CORRUPTION]
    assert diff.title == "differential diagnosis: corruption"
    assert line(diff, "collective").startswith(
        "collective: ruled out: collectives healthy: all_reduce p99 <= 5 ms")


def test_a_leak_on_a_single_rank_worker_names_the_leak_and_no_collective():
    idle_leak = dict(held=12, running=0, waiting=0, live=0)
    problems, diff = findings(worker_metrics(**idle_leak), worker_metrics(**idle_leak))
    assert {f.problem for f in problems} == {Problem.LEAK}
    assert diff.title == "differential diagnosis: leak"
    assert line(diff, "collectives") == ("collectives: not tensor-parallel (one rank); not the "
                                         "cause")
