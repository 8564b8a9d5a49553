"""Recorded /metrics series of a live worker under a fault, and the promtool unit test that reads
them against deploy/prometheus/alerts.yml.

A `Recording` keeps, per scrape, the samples of every series the alert rules read (plus `up`:
1 for a scrape that answered, 0 for one that did not, as Prometheus synthesizes it), under fixed
`job`/`instance` labels and `model_name="m"` so recordings are stable across runs. As promtool
input each scrape is one sample a minute of rule time: the recorded sequence of values is kept,
time is stretched (ratios such as quantiles and increases are what the rules compare; a scrape
taken while a fault lasts reads as a minute of it).

`alerts_firing` runs `promtool test rules` with one `promql_expr_test` per requested eval time:
`group by (alertname) (ALERTS{alertstate="firing"})` must equal exactly the expected set, so an
alert that should stay quiet and fires fails the test as surely as one that should fire and does
not.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.ops.promql import metric_names

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "alerts.yml"
RECORDINGS = REPO / "tests" / "data" / "fault_series"
RECORD_VAR = "KVSERVE_RECORD_FAULT_SERIES"  # =1: a live run rewrites the committed recordings
TARGET = {"job": "kvserve-worker", "instance": "w0:8000"}
UP = 'up{instance="w0:8000",job="kvserve-worker"}'
EXTRA_NAMES = {"kvserve:kv_held_blocks"}  # read by the tests themselves, not by a rule


def rule_series_names() -> set[str]:
    """Every metric name an expression in alerts.yml reads (histograms by their _bucket)."""
    import yaml

    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {n for g in groups for r in g["rules"] for n in metric_names(r["expr"])} | EXTRA_NAMES


def _series_key(name: str, labels: Mapping[str, str]) -> str:
    merged = {**labels, **TARGET}
    if "model_name" in merged:
        merged["model_name"] = "m"
    body = ",".join(f'{k}="{v}"' for k, v in sorted(merged.items()))
    return f"{name}{{{body}}}"


@dataclass
class Recording:
    """The rule-relevant series of one worker, one column per scrape."""

    names: set[str] = field(default_factory=rule_series_names)
    scrapes: list[dict[str, float]] = field(default_factory=list)

    def scrape(self, url: str) -> bool:
        """Read `url`/metrics once; a failed read records `up` 0 (and no other sample)."""
        try:
            response = httpx.get(f"{url}/metrics", timeout=5.0)
            response.raise_for_status()
        except httpx.HTTPError:
            self.scrapes.append({_series_key("up", {}): 0.0})
            return False
        samples = {_series_key("up", {}): 1.0}
        for family in text_string_to_metric_families(response.text):
            for s in family.samples:
                if s.name in self.names:
                    samples[_series_key(s.name, s.labels)] = float(s.value)
        self.scrapes.append(samples)
        return True

    def series(self) -> dict[str, str]:
        """Each series' values in promtool's notation, runs folded (`3x4`: five 3s); a series
        missing from a scrape after it was present is marked stale once (as Prometheus does
        when a target stops exporting it), then absent (`_`)."""
        out = {}
        for key in sorted({k for s in self.scrapes for k in s}):
            values, seen = [], False
            for scrape in self.scrapes:
                value = scrape.get(key)
                values.append(_fmt(value) if value is not None else "stale" if seen else "_")
                seen = value is not None
            out[key] = " ".join(_runs(values))
        return out

    def input_series(self) -> list[dict[str, str]]:
        return [{"series": k, "values": v} for k, v in self.series().items()]

    def value(self, idx: int, name: str, **labels: str) -> float | None:
        """The sum of scrape `idx`'s samples of `name` whose labels include `labels`."""
        found = None
        for key, value in self.scrapes[idx].items():
            metric, _, body = key.partition("{")
            if metric == name and all(f'{k}="{v}"' in body for k, v in labels.items()):
                found = (found or 0.0) + value
        return found

    def save(self, name: str, directory: Path = RECORDINGS) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{name}.json"
        path.write_text(json.dumps({"scrapes": len(self.scrapes), "series": self.series()},
                                   indent=0) + "\n")
        return path

    @classmethod
    def load(cls, name: str, directory: Path = RECORDINGS) -> Recording:
        data = json.loads((directory / f"{name}.json").read_text())
        scrapes: list[dict[str, float]] = [{} for _ in range(data["scrapes"])]
        for key, values in data["series"].items():
            expanded = [v for token in values.split() for v in _unfold(token)]
            assert len(expanded) == len(scrapes), key
            for scrape, value in zip(scrapes, expanded, strict=True):
                if value is not None:
                    scrape[key] = value
        return cls(names=set(), scrapes=scrapes)


def _runs(values: list[str]) -> list[str]:
    out: list[str] = []
    for value in values:
        if out and value not in ("_", "stale") and out[-1].partition("x")[0] == value:
            head, _, count = out[-1].partition("x")
            out[-1] = f"{head}x{int(count or 0) + 1}"
        else:
            out.append(value)
    return out


def _unfold(token: str) -> list[float | None]:
    if token in ("_", "stale"):
        return [None]
    head, _, count = token.partition("x")
    return [float(head)] * (int(count or 0) + 1)


def _fmt(value: float | None) -> str:
    if value is None:
        return "_"
    return repr(int(value)) if value == int(value) else repr(value)


def promtool_path() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not on PATH: install the Debian package `prometheus` "
                    "(`make tools` does, as root)")
    return path


def check_alerts(recording: Recording, expected: Mapping[int, Iterable[str]],
                 work_dir: Path) -> None:
    """Assert, with promtool, that at each scrape index in `expected` exactly the named alerts
    fire on `recording`'s series (none where the set is empty)."""
    import yaml

    promtool = promtool_path()
    last = len(recording.scrapes) - 1
    checks = []
    for idx, names in sorted(expected.items()):
        assert 0 <= idx <= last, f"scrape {idx} was not recorded (0..{last})"
        checks.append({"expr": 'group by (alertname) (ALERTS{alertstate="firing"})',
                       "eval_time": f"{idx}m",
                       "exp_samples": [{"labels": f'{{alertname="{n}"}}', "value": 1}
                                       for n in sorted(set(names))]})
    test = {"rule_files": [str(RULES)], "evaluation_interval": "1m",
            "tests": [{"name": "recorded fault", "interval": "1m",
                       "input_series": recording.input_series(),
                       "promql_expr_test": checks}]}
    path = work_dir / "fault_alerts_test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False, width=1_000_000))
    result = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
