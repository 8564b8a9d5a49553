"""The chaos harness's judge on a planted recording (no fleet): promtool's firing alerts are read
back per scrape and attributed to the fault whose window they start in; a lost request, an
alert no fault explains, a missing alert and a dirty quiet check each fail their verdict."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from benchmarks.chaos.alerts import eval_minutes
from benchmarks.chaos.verdicts import growth, judge

T0 = 1_000_000.0
STEP = 5.0
SCRAPES = 100
# worker0 does not answer its scrapes here: past an hour of rule time, where promtool writes
# eval times as `1h12m` (read as 12 minutes, the alert landed an hour early, unexplained)
DOWN = range(70, 78)
FAULT: dict[str, Any] = {
         "fault": "worker_stop", "what": "planted", "target": 0, "inject": T0 + 70 * STEP,
         "inject_error": None, "recover": T0 + 78 * STEP, "recovered": T0 + 78.5 * STEP,
         "recover_error": None, "end": T0 + 82 * STEP,
         "doctor_during": {"t": 0, "ended": T0 + 74 * STEP, "problems": {"down": ["w0"]}},
         "doctor_after": {"t": 0, "ended": T0 + 82 * STEP, "problems": {}},
         "quiet": {"clean": True}}


def plant(out: Path, corruption_at: int | None = None, lost: bool = False,
          fault: dict[str, Any] | None = None, audit_at: int | None = None) -> None:
    out.mkdir()
    times = [T0 + i * STEP for i in range(SCRAPES)]
    labels = 'instance="worker0",job="kvserve-worker"'
    scrapes = []
    for i in range(SCRAPES):
        if i in DOWN:
            scrapes.append({f"up{{{labels}}}": 0.0})
            continue
        corrupt = 1.0 if corruption_at is not None and i >= corruption_at else 0.0
        audits = 1.0 if audit_at is not None and i >= audit_at else 0.0
        scrapes.append({f"up{{{labels}}}": 1.0,
                        f"kvserve:kv_corruption_detections_total{{{labels}}}": corrupt,
                        f"kvserve:kv_audit_failures_total{{{labels}}}": audits})
    (out / "series.json").write_text(json.dumps(
        {"times": times, "series": {"worker0": ["kvserve-worker", scrapes]}}))
    run = {"config": {"interval_s": STEP, "settle_s": 5.0, "warmup_s": 10.0},
           "began": T0, "ended": T0 + SCRAPES * STEP, "faults": [fault or FAULT],
           "quiet_checks": [{"clean": True}], "skipped": {}}
    (out / "run.json").write_text(json.dumps(run))
    rows = [{"began": T0 + 60, "ended": T0 + 61, "outcome": "lost" if lost else "answered"}]
    (out / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(autouse=True)
def _promtool() -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not on PATH: `make tools` installs it (Debian `prometheus`)")


def test_a_fault_with_its_alert_and_doctor_passes(tmp_path: Path) -> None:
    plant(tmp_path / "run")
    result = judge(tmp_path / "run")
    (stop,) = result["faults"]
    assert "KVServeWorkerScrapeDown" in stop["alerts"] and not stop["missing_alerts"]
    assert stop["detect_s"] is not None and 0 < stop["detect_s"] <= 5 * STEP
    assert result["verdicts"] == {k: True for k in result["verdicts"]}, result["verdicts"]


def test_a_lost_request_fails_the_run(tmp_path: Path) -> None:
    plant(tmp_path / "run", lost=True)
    assert judge(tmp_path / "run")["verdicts"]["lost_0"] is False


def test_an_alert_no_fault_explains_fails_the_run(tmp_path: Path) -> None:
    plant(tmp_path / "run", corruption_at=97)  # long after the fault's window
    result = judge(tmp_path / "run")
    assert [s["alert"] for s in result["unexplained_alerts"]] == ["KVServeCacheCorruption"]
    assert result["verdicts"]["no_unexplained_alert"] is False


def test_a_fault_whose_alert_never_fired_fails_the_run(tmp_path: Path) -> None:
    fault = {**FAULT, "fault": "corruption",
             "doctor_during": {**FAULT["doctor_during"], "problems": {"corruption": ["w0"]}}}
    plant(tmp_path / "run", fault=fault)
    result = judge(tmp_path / "run")
    assert result["faults"][0]["missing_alerts"] == ["KVServeCacheCorruption"]
    assert result["verdicts"]["alerts_fired"] is False


def _named(fault: str, *problems: str) -> dict[str, Any]:
    return {**FAULT, "fault": fault, "doctor_during": {
        **FAULT["doctor_during"], "problems": {p: ["w0"] for p in problems}}}


def test_a_planted_corruption_also_caught_by_the_audit_is_one_fault(tmp_path: Path) -> None:
    """The audit is a second detector of a reassigned block (a stale hash): its alert and the
    doctor's "audit" belong to the corruption's window, not to a fault nobody injected."""
    plant(tmp_path / "run", fault=_named("corruption", "corruption", "audit"),
          corruption_at=80, audit_at=80)
    result = judge(tmp_path / "run")
    (fault,) = result["faults"]
    assert {"KVServeCacheCorruption", "KVServeAuditFailure"} <= set(fault["alerts"])
    assert fault["others_ruled_out"] and not result["unexplained_alerts"]
    assert result["verdicts"] == {k: True for k in result["verdicts"]}, result["verdicts"]


def test_an_audit_failure_during_another_fault_is_not_explained_by_it(tmp_path: Path) -> None:
    plant(tmp_path / "run", fault=_named("worker_stop", "down", "audit"), audit_at=80)
    result = judge(tmp_path / "run")
    assert [s["alert"] for s in result["unexplained_alerts"]] == ["KVServeAuditFailure"]
    assert result["faults"][0]["others_ruled_out"] is False
    assert not result["verdicts"]["doctor_named"]


def _life(proc: str, start: float, minutes: float,
          rss: tuple[float, float]) -> list[dict[str, Any]]:
    """One incarnation sampled every 5 s: RSS steps from rss[0] to rss[1] halfway through."""
    n = int(minutes * 12)
    return [{"proc": proc, "t": start + 5.0 * k, "alive": True, "fds": 30, "threads": 20,
             "rss_mib": rss[0] if k < n // 2 else rss[1]} for k in range(n)]


def test_growth_is_judged_over_lives_long_enough_to_show_a_drift() -> None:
    """A worker restarted late grows while load first reaches it (warm-up, too short to judge);
    a long-lived process that grows past the bound fails."""
    rows = (_life("gateway0", 0.0, 40, (80, 81))
            + _life("worker2", 0.0, 20, (700, 710)) + [
                {"proc": "worker2", "t": 1201.0, "alive": False}]
            + _life("worker2", 1300.0, 3, (722, 795)))
    by = {(g["proc"], g["incarnation"]): g for g in growth(rows, 0.0)}
    assert by[("gateway0", 1)]["judged"] and by[("gateway0", 1)]["ok"]
    assert by[("worker2", 1)]["judged"] and by[("worker2", 1)]["ok"]
    assert not by[("worker2", 2)]["judged"] and not by[("worker2", 2)]["ok"]
    leaking = growth(_life("gateway0", 0.0, 40, (80, 200)), 0.0)
    assert leaking[0]["judged"] and not leaking[0]["ok"]


def test_promtools_eval_times_read_in_minutes() -> None:
    assert [eval_minutes(t) for t in ("0s", "45m", "1h", "1h12m", "1d2h3m")] == [
        0, 45, 60, 72, 1563]
    with pytest.raises(ValueError, match="duration"):
        eval_minutes("12x")
