"""The alert rules: promtool accepts them and their unit tests pass; every alert carries a
severity and the annotations on-call reads; and every alert has a firing case and a quiet case
in deploy/prometheus/alerts_test.yml (or another *_test.yml there, one per rule group's owner)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = PROMETHEUS / "alerts.yml"
RULE_TESTS = PROMETHEUS / "alerts_test.yml"
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
        assert alert["labels"]["severity"] in ("critical", "warning"), alert["alert"]
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
