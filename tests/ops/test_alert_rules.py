"""The alert rules: promtool accepts them and their unit tests pass; every alert carries a
severity and the annotations on-call reads; every alert has a firing case and a quiet case
in deploy/prometheus/alerts_test.yml (or another *_test.yml there, one per rule group's owner);
and the groups keep their convention: `workers-*` rules read only what vLLM 0.32's own workers
export (checked against its recorded /metrics), so they work on a plain vLLM fleet, and
`kvserve-only-*` rules read kvserve's own worker series."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.ops.promql import exported_names, metric_names

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = PROMETHEUS / "alerts.yml"
VLLM_METRICS = Path(__file__).resolve().parents[1] / "data" / "vllm_metrics" / "burst.prom"
# Informational alerts (route them to a dashboard, not a pager): what the fleet cannot be
# alerted on, not something wrong.
INFO_ALERTS = {"KVServeOnlyAlertsInactive"}
ALL_RULE_TESTS = sorted(PROMETHEUS.glob("*_test.yml"))


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not on PATH: install the Debian package `prometheus` "
                    "(`make tools` does, as root)")
    return subprocess.run([path, *args], cwd=PROMETHEUS, capture_output=True, text=True,
                          timeout=120, check=False)


def test_promtool_check_rules() -> None:
    result = promtool("check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_test_rules() -> None:
    result = promtool("test", "rules", *(path.name for path in ALL_RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def _load(path: Path) -> Any:
    yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read the alert rules")
    return yaml.safe_load(path.read_text())


def alerts() -> list[dict[str, Any]]:
    return [r for g in _load(RULES)["groups"] for r in g["rules"] if "alert" in r]


def test_every_alert_has_severity_and_runbook() -> None:
    names = [a["alert"] for a in alerts()]
    assert len(names) == len(set(names)) and len(names) >= 15
    for alert in alerts():
        allowed = ("info",) if alert["alert"] in INFO_ALERTS else ("critical", "warning")
        assert alert["labels"]["severity"] in allowed, alert["alert"]
        for key in ("summary", "description", "runbook"):
            assert alert["annotations"].get(key, "").strip(), f"{alert['alert']}: no {key}"


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in (c for path in ALL_RULE_TESTS for c in _load(path)["tests"]):
        for check in case.get("promql_expr_test", []):
            if "ALERTS{" in check["expr"] and 'alertstate="firing"' in check["expr"]:
                firing.update(s["labels"].split('alertname="')[1].split('"')[0]
                              for s in check.get("exp_samples", []))
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {a["alert"] for a in alerts()}
    assert not names - firing, f"alerts never shown firing: {sorted(names - firing)}"
    assert not names - quiet, f"alerts never shown quiet: {sorted(names - quiet)}"


def test_groups_split_vllm_computable_rules_from_kvserve_only_ones() -> None:
    vllm = exported_names(VLLM_METRICS.read_text()) | {"up"}
    groups = _load(RULES)["groups"]
    recorded = {r["record"] for g in groups for r in g["rules"] if "record" in r}
    kinds = {"workers", "kvserve-only", "kvserve-gateway", "fleet-coverage"}
    for group in groups:
        kind = next((k for k in sorted(kinds, key=len, reverse=True)
                     if group["name"].startswith(k)), None)
        assert kind, f"group {group['name']}: name it workers-*, kvserve-only-*, ..."
        for rule in group["rules"]:
            name = rule.get("alert") or rule["record"]
            names = metric_names(rule["expr"]) - recorded
            worker_series = {n for n in names if n.startswith("kvserve:")
                             and not n.startswith("kvserve:gateway_")}
            if kind == "workers":
                # vLLM's workers export these; a gateway's series may guard, never decide
                assert not worker_series and names - vllm <= {
                    n for n in names if n.startswith("kvserve:gateway_")}, (name, names - vllm)
            elif kind == "kvserve-only":
                assert worker_series, f"{name} reads no kvserve worker series: move it"
            elif kind == "kvserve-gateway":
                assert names and all(n.startswith("kvserve:gateway_") for n in names), name
    coverage = [r for g in groups if g["name"] == "fleet-coverage" for r in g["rules"]]
    assert [r["alert"] for r in coverage] == ["KVServeOnlyAlertsInactive"]
    scrape = next(r for g in groups for r in g["rules"]
                  if r.get("alert") == "KVServeWorkerScrapeDown")
    assert 'job=~"kvserve.*"' not in scrape["expr"], "scrape-down must cover vLLM jobs too"
