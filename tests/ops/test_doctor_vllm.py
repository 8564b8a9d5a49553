"""The doctor on a plain vLLM worker, from vLLM 0.32's own /metrics recorded here
(tests/data/vllm_metrics): healthy -> exit 0 with the kvserve-only checks listed as not run;
a burst that fills the KV cache -> saturation named; the leak signature -> a critical leak."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rich.console import Console

from kvserve.ops.diagnose import diagnose
from kvserve.ops.doctor_command import render
from kvserve.ops.findings import Problem, Report, Severity
from kvserve.ops.scrape import Kind, Metrics, Observation, Snapshot
from kvserve.ops.vllm_worker_checks import KVSERVE_ONLY_CHECKS

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm_metrics"
URL = "http://vllm:8000"
MODELS = {"data": [{"id": "tiny-llama", "max_model_len": 256}]}


def recorded(name: str) -> str:
    return (DATA / f"{name}.prom").read_text()


def observe(first: str, second: str, interval_s: float = 5.0) -> Observation:
    """Two snapshots of a vLLM worker as the doctor's reader would take them."""
    return Observation(URL, Snapshot(URL, 0.0, Metrics.from_text(first), 200, models=MODELS),
                       Snapshot(URL, interval_s, Metrics.from_text(second), 200, models=MODELS))


def with_gauge(text: str, name: str, value: float, label: str = "") -> str:
    """`text` with the one sample of gauge `name` whose labels contain `label` set to `value`
    (a recording with numbers changed)."""
    pattern = rf"^({re.escape(name)}\{{[^}}]*{re.escape(label)}[^}}]*\}}) \S+$"
    changed, n = re.subn(pattern, rf"\g<1> {value}", text, flags=re.M)
    assert n == 1, name
    return changed


def problems(report: Report, problem: Problem) -> list[str]:
    return [f.title for f in report.findings
            if f.problem is problem and f.severity > Severity.INFO]


def rendered(report: Report) -> str:
    console = Console(record=True, width=200, highlight=False)
    render(report, console)
    return console.export_text()


def test_recordings_are_vllm_workers_without_kvserve_series() -> None:
    for name in ("idle", "burst", "burst_2", "after", "leak_1"):
        metrics = Metrics.from_text(recorded(name))
        assert metrics.kind() is Kind.VLLM_WORKER, name
        assert not [n for n, _, _ in metrics.samples if n.startswith("kvserve:")]


def test_healthy_vllm_worker_exits_zero_and_lists_what_it_could_not_check() -> None:
    report = diagnose([observe(recorded("idle"), recorded("after"))])
    assert report.exit_code == 0, [f.to_dict() for f in report.findings]
    (note,) = [f for f in report.findings if f.title.startswith("not checked on ")]
    assert note.severity is Severity.INFO and f"not checked on {URL}" in note.title
    assert len(note.evidence) == len(KVSERVE_ONLY_CHECKS)
    for needed in ("kvserve:kv_corruption_detections_total", "kvserve:kv_audit_failures_total",
                   "kvserve:kv_live_requests", "kvserve:kv_reclaimed_blocks_total"):
        assert any(needed in line for line in note.evidence), needed
    text = rendered(report)
    assert "needs kvserve metrics" in text and "not run there" in text
    assert "healthy: nothing wrong found in what could be checked" in text


def test_burst_that_fills_the_kv_cache_is_saturation() -> None:
    report = diagnose([observe(recorded("burst"), recorded("burst_2"))])
    (finding,) = [f for f in report.findings if f.problem is Problem.SATURATION]
    assert finding.severity is Severity.WARNING and report.exit_code == 1
    assert any(line.startswith("KV cache 100% then 100% used with") and "capacity" in line
               for line in finding.evidence), finding.evidence
    assert "the worker is saturated" in rendered(report)


def test_kv_cache_full_with_a_short_queue_is_saturation() -> None:
    """Below the queue-length threshold, a full KV cache with requests waiting still is."""
    text = with_gauge(with_gauge(recorded("burst"), "vllm:kv_cache_usage_perc", 0.97),
                      "vllm:num_requests_waiting", 3)
    text = with_gauge(text, "vllm:num_requests_waiting_by_reason", 3, 'reason="capacity"')
    report = diagnose([observe(text, text)])
    (finding,) = [f for f in report.findings if f.problem is Problem.SATURATION]
    assert finding.evidence == ("KV cache 97% then 97% used with 3 then 3 requests waiting, 3 "
                                "of them for lack of capacity: the KV cache, not compute, "
                                "limits the batch",)
    # full but nothing waiting: a cache in use, not a saturated worker
    busy = with_gauge(with_gauge(recorded("burst"), "vllm:kv_cache_usage_perc", 0.97),
                      "vllm:num_requests_waiting", 0)
    assert not problems(diagnose([observe(busy, busy)]), Problem.SATURATION)


@pytest.mark.parametrize("pair", [("leak_1", "leak_2"), ("leak_1", "leak_4")])
def test_leak_signature_is_a_critical_leak(pair: tuple[str, str]) -> None:
    report = diagnose([observe(recorded(pair[0]), recorded(pair[1]))])
    (title,) = problems(report, Problem.LEAK)
    assert title == ("KV blocks leak: 25% of the KV cache held (about 8 of 32 blocks) with "
                     "nothing running or waiting")
    assert report.exit_code == 2 and report.findings[0].problem is Problem.LEAK
    assert "KV blocks leak" in rendered(report)


def test_usage_with_requests_running_is_no_leak() -> None:
    # the same held KV while one request still runs in either snapshot
    running = with_gauge(recorded("leak_1"), "vllm:num_requests_running", 1)
    for pair in ((running, recorded("leak_2")), (recorded("leak_1"), running)):
        assert not problems(diagnose([observe(*pair)]), Problem.LEAK)
    # and an idle worker whose usage went back to 0 in the second snapshot
    assert not problems(diagnose([observe(recorded("leak_1"), recorded("after"))]),
                        Problem.LEAK)


def test_every_recording_pair_diagnoses_without_error() -> None:
    names = ("idle", "burst", "burst_2", "after", "leak_1", "leak_4")
    for first in names:
        for second in names:
            report = diagnose([observe(recorded(first), recorded(second))])
            rendered(report)
            assert report.to_dict()["targets"][0]["kind"] == Kind.VLLM_WORKER.value


def test_admission_rejections_are_saturation_counted_once() -> None:
    line = 'vllm:admission_rejections_total{model_name="tiny-llama",reason="max_num_queued_reqs"}'
    before = recorded("after")
    after = before.replace(f"{line} 0.0", f"{line} 5.0")
    assert after != before
    (finding,) = [f for f in diagnose([observe(before, after)]).findings
                  if f.problem is Problem.SATURATION]
    assert finding.evidence == ("refused 5 requests (429) in 5.0s",)
    # a kvserve worker counts each 429 in its own counter too: once, not twice
    kvserve = 'kvserve:kv_held_blocks{model_name="m"} 0\n'
    first = Metrics.from_text(kvserve + 'kvserve:requests_rejected_total{cause="queue_full"} 0\n'
                              + before)
    second = Metrics.from_text(kvserve + 'kvserve:requests_rejected_total{cause="queue_full"} 5\n'
                               + after)
    report = diagnose([Observation(URL, Snapshot(URL, 0.0, first, 200),
                                   Snapshot(URL, 5.0, second, 200))])
    (finding,) = [f for f in report.findings if f.problem is Problem.SATURATION]
    assert finding.evidence == ("refused 5 requests (429) in 5.0s",)
